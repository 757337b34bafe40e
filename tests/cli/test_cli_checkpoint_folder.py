"""`zerocc train --save` into a folder of checkpoints that are not the run's own (issue 77):
refused by name before any step, or replaced with `--overwrite`, which says what it deleted;
and `zerocc checkpoint` says where the folder's `latest` names no checkpoint, or is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from train_runs import one_rank_saves

from zerocc.cli.main import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"
ON_CPU = ["--nproc", "1", "--set", "backend.device=cpu"]


def _train(*flags: str) -> int:
    return main(["train", str(EXAMPLE), *ON_CPU, *flags])


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_run_that_saves_among_another_runs_checkpoints_is_refused_or_replaces_them(
    tmp_path, capsys
):
    """A run of 3 steps saves steps 1-3 in A; a new run of 1 step saving in A without
    --resume was let through: it printed `checkpoint: A/step-00000001`, which keep 3 then
    deleted (the oldest by name), `latest` naming it. Now it is refused before it trains,
    naming the checkpoints, and A is as it was; with --overwrite they are deleted first, said,
    and A holds the new run's save alone."""
    saves = tmp_path / "A"
    assert _train("--steps", "3", "--save", str(saves), "--save-every", "1") == 0
    before = _names(saves)
    assert before == ["latest", "step-00000001", "step-00000002", "step-00000003"]
    capsys.readouterr()

    assert _train("--steps", "1", "--save", str(saves)) == 2
    said = capsys.readouterr()
    assert f"--save {saves} holds checkpoints of another run (step-00000001, step-00000002, " \
           f"step-00000003): this run's saves would mix with them. Go on from them with " \
           f"--resume {saves}, replace them with --overwrite, or save to another folder" \
           in said.err  # fmt: skip
    assert "final loss" not in said.out  # (refused before any step)
    assert _names(saves) == before and (saves / "latest").read_text() == "step-00000003\n"

    assert _train("--steps", "1", "--save", str(saves), "--overwrite") == 0
    out = capsys.readouterr().out
    assert f"zerocc: --overwrite: deleted step-00000001, step-00000002, step-00000003 from " \
           f"{saves} (another run's)" in out  # fmt: skip
    assert f"checkpoint: {saves / 'step-00000001'}" in out
    assert _names(saves) == ["latest", "step-00000001"]
    assert (saves / "latest").read_text() == "step-00000001\n"


def test_a_run_resumed_from_its_save_folder_goes_on_there(tmp_path, capsys):
    """--resume of the folder it saves to: its own checkpoints, no refusal; resumed from an
    earlier one there, the later ones are refused by name."""
    saves = tmp_path / "A"
    assert _train("--steps", "2", "--save", str(saves), "--save-every", "1") == 0
    assert _train("--steps", "3", "--save", str(saves), "--resume", str(saves)) == 0
    assert _names(saves) == ["latest", "step-00000001", "step-00000002", "step-00000003"]
    capsys.readouterr()
    earlier = saves / "step-00000001"
    assert _train("--steps", "2", "--save", str(saves), "--resume", str(earlier)) == 2
    assert f"--save {saves} holds step-00000002, step-00000003, later than step-00000001 " \
           "this run resumes from" in capsys.readouterr().err  # fmt: skip


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    """Two checkpoints of one rank (steps 1 and 2)."""
    return one_rank_saves(tmp_path_factory.mktemp("saves"))


def test_a_latest_that_names_no_checkpoint_is_said(saves, tmp_path, capsys):
    """`latest` names a checkpoint that is not there: the list says so and the command ends
    2 naming it (a resume of the folder refuses alike); nothing was marked latest, unsaid."""
    folder = tmp_path / "saves"
    shutil.copytree(saves, folder)
    (folder / "latest").write_text("step-00000009\n")
    assert main(["checkpoint", str(folder)]) == 2
    said = capsys.readouterr()
    assert "  latest: names step-00000009, which is not there (deleted since it was saved): " \
           "a resume of this folder refuses; name the checkpoint to load" in said.out  # fmt: skip
    assert f"{folder / 'latest'} names step-00000009, which is not there" in said.err
    assert main(["checkpoint", str(folder / "step-00000002")]) == 0  # (named: shown)


def test_a_missing_latest_is_said(saves, tmp_path, capsys):
    folder = tmp_path / "saves"
    shutil.copytree(saves, folder)
    (folder / "latest").unlink()
    assert main(["checkpoint", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "  latest: missing (not written by a save: a resume of this folder loads its " \
           "newest, step-00000002)" in out  # fmt: skip
    assert "(latest)" not in out and f"{folder / 'step-00000002'}: after optimizer step 2" in out
