"""Tests of the `zerocc plan` commands in zerocc/cli.py."""

import json
from pathlib import Path

import pytest

from zerocc.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "gpt"


@pytest.mark.parametrize(
    "name",
    ["zero0.yaml", "zero1.yaml", "zero2.yaml", "zero3.yaml", "zero3-bf16.yaml",
     "zero3-offload.yaml"],
)  # fmt: skip
def test_plan_check_accepts_each_example(capsys, name):
    path = EXAMPLES / name
    assert main(["plan", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: ok (stage {name[4]}," in out
    if "offload" in name:
        assert (
            "partition -> recompute -> shard -> precision -> optimizer -> overlap -> offload" in out
        )
    elif "bf16" in name:
        assert "partition -> shard -> precision -> optimizer" in out
        assert "bf16 compute, fp32 reduce, fp32 master, no loss scaling" in out
    else:
        assert "partition -> shard -> optimizer" in out and "fp32," in out


def test_plan_check_rejects_a_bad_plan(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("zero:\n  stage: 4\n")
    assert main(["plan", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert str(path) in captured.err and "zero.stage" in captured.err
    assert "allowed values: 0, 1, 2, 3" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("command", ["plan check", "train"])
def test_a_missing_nvme_folder_fails_before_any_rank_starts(tmp_path, capsys, command):
    path = tmp_path / "nvme.yaml"
    path.write_text(f"offload: {{optimizer: nvme, nvme_path: {tmp_path / 'absent'}}}\n")
    assert main([*command.split(), str(path)]) == 2
    err = capsys.readouterr().err
    assert "offload.nvme_path" in err and "does not exist" in err and "Traceback" not in err


def test_plan_check_missing_file(tmp_path, capsys):
    assert main(["plan", "check", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_plan_schema_prints_json(capsys):
    assert main(["plan", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Plan" and "zero" in schema["properties"]


@pytest.mark.parametrize("argv", [[], ["plan"]])
def test_no_command_prints_help(capsys, argv):
    assert main(argv) == 0
    assert "usage: zerocc" in capsys.readouterr().out
