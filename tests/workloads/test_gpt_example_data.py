"""The GPT example on a user's own data (issue 50: "training the example on their own text or
token files"): a text file, char-level over its characters; nanoGPT's ``.bin`` token files,
``.npy`` arrays, or a folder of them; `zerocc train --data PATH` from the current folder."""

from __future__ import annotations

from pathlib import Path

import data
import numpy as np
import pytest
import torch

from zerocc.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"


def test_a_text_file_is_char_level_over_its_own_characters(tmp_path):
    (tmp_path / "mine.txt").write_text("abcab")
    corpus = data.load(tmp_path / "mine.txt")
    assert corpus.vocab_size == 3 and corpus.tokens.tolist() == [0, 1, 2, 0, 1]


def test_token_files_bin_npy_and_folders_concatenate_in_name_order(tmp_path):
    np.array([3, 1, 4], dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", np.array([1, 5, 9]))
    (tmp_path / "notes.md").write_text("not tokens")
    assert data.load(tmp_path / "a.bin").tokens.tolist() == [3, 1, 4]
    corpus = data.load(tmp_path)
    assert corpus.tokens.tolist() == [3, 1, 4, 1, 5, 9] and corpus.vocab_size == 10
    assert corpus.tokens.dtype == torch.long
    held = len(corpus.tokens) // 10
    assert torch.equal(torch.cat([corpus.train, corpus.held_back]), corpus.tokens)
    assert len(corpus.held_back) == held


@pytest.mark.parametrize(
    ("name", "says"),
    [("", "holds no token files"), ("missing.txt", "not found"), ("empty.txt", "is empty")],
)
def test_data_with_nothing_to_train_on_is_named(tmp_path, name, says):
    (tmp_path / "empty.txt").write_text("")
    path = tmp_path / name if name else tmp_path
    if not name:
        (tmp_path / "empty.txt").unlink()
    with pytest.raises(ValueError, match=f"data: {tmp_path}.*{says}"):
        data.load(path)


def test_train_and_plan_check_take_data_from_the_current_folder(tmp_path, monkeypatch, capsys):
    text = "to be or not to be, " * 40
    (tmp_path / "mine.txt").write_text(text)
    monkeypatch.chdir(tmp_path)  # (a plan's own relative paths start at its folder)
    plan = str(EXAMPLES / "zero3.yaml")
    assert main(["plan", "check", plan, "--data", "mine.txt"]) == 0
    mine = capsys.readouterr().out
    assert main(["plan", "check", plan]) == 0
    embedded = capsys.readouterr().out
    # its 8 characters against the embedded text's 56: a smaller embedding (tied to the head)
    width = 128  # the example's n_embd
    params = [int(o.split("; model GPT, ")[1].split(" parameters")[0].replace(",", ""))
              for o in (mine, embedded)]  # fmt: skip
    assert params[1] - params[0] == (data.vocab_size - len(set(text))) * width
    assert main(["plan", "check", plan, "--data", "missing.txt"]) == 2
    assert f"workload_args.data: {tmp_path / 'missing.txt'} not found" in capsys.readouterr().err
