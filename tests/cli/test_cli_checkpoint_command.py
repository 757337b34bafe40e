"""`zerocc checkpoint PATH [--verify]`: a folder's checkpoints listed, what one holds, and
every byte checked against its digest, each damage named (no model built, no rank)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from models import build
from train_runs import one_rank_saves

import zerocc
from zerocc.cli.main import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    """Two checkpoints of one rank (steps 1 and 2) and a save of step 3 that did not finish."""
    root = one_rank_saves(tmp_path_factory.mktemp("saves"))
    shutil.copytree(root / "step-00000002", root / ".step-00000003.partial")
    return root


def test_a_folder_lists_its_checkpoints_and_says_what_the_latest_holds(saves, capsys):
    assert main(["checkpoint", str(saves)]) == 0
    out = capsys.readouterr().out
    assert f"{saves}: 2 checkpoint(s)" in out
    listed = [line for line in out.splitlines() if line.startswith("  step-")]
    assert [line.split()[0] for line in listed] == ["step-00000001", "step-00000002"]
    assert "(latest)" in listed[1] and "(latest)" not in listed[0]
    assert ".step-00000003.partial: a save that did not finish" in out
    latest = saves / "step-00000002"
    assert f"{latest}: after optimizer step 2 (step 2, micro-batch 2), saved by 1 rank at " in out
    params = sum(p.numel() for p in build("gpt").parameters())
    assert f"parameters, {params:,} elements ({params:,} trainable)" in out
    assert "optimizer: adamw (exp_avg, exp_avg_sq); loss scale: none" in out


def test_verify_reads_every_chunk_of_an_intact_checkpoint(saves, capsys):
    assert main(["checkpoint", str(saves / "step-00000001"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "step-00000002" not in out  # (one checkpoint named: no list)
    manifest = json.loads((saves / "step-00000001" / "manifest.json").read_text())
    chunks = sum(len(t["chunks"]) for t in manifest["tensors"].values())
    assert f"verified: {chunks} chunks of {len(manifest['tensors'])} tensors" in out


def _damaged(saves: Path, tmp_path: Path, damage) -> Path:
    folder = tmp_path / "step-00000002"
    shutil.copytree(saves / "step-00000002", folder)
    damage(folder)
    return folder


def _flip_a_byte(folder: Path) -> None:
    data = bytearray((folder / "rank-00000.bin").read_bytes())
    data[100] ^= 0xFF
    (folder / "rank-00000.bin").write_bytes(data)


def _drop_a_chunk(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    name = next(n for n, t in manifest["tensors"].items() if n.startswith("model/"))
    manifest["tensors"][name]["chunks"].pop()
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_flip_a_byte, "rank-00000.bin: checksum mismatch in "),
        (lambda f: (f / "rank-00000.bin").unlink(), "rank-00000.bin: missing (saved by rank 0)"),
        (_drop_a_chunk, "(a rank's part is missing from the manifest)"),
    ],
    ids=["a-byte-flipped", "a-file-missing", "a-chunk-dropped"],
)
def test_verify_names_what_is_damaged(saves, tmp_path, capsys, damage, said):
    folder = _damaged(saves, tmp_path, damage)
    assert main(["checkpoint", str(folder), "--verify"]) == 2
    assert said in capsys.readouterr().err


def test_a_folder_without_a_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "no such checkpoint or checkpoint folder" in capsys.readouterr().err
    assert main(["checkpoint", str(tmp_path)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_train_refuses_to_resume_a_checkpoint_of_another_model_before_any_rank_starts(
    saves, monkeypatch, capsys
):
    """`zerocc train --resume` checks the checkpoint against the plan's model and optimizer
    before it launches ranks (each would compile first, then fail alike)."""
    from zerocc.cli import train_command

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks launched")

    monkeypatch.setattr(train_command, "launch_ranks", no_launch)
    example = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"
    train = ["train", str(example), "--nproc", "2", "--steps", "1", "--resume"]
    assert main([*train, str(saves)]) == 2
    said = capsys.readouterr().err
    assert f"--resume {saves / 'step-00000002'}: the checkpoint is of another model" in said
    assert main([*train, str(saves / "nowhere")]) == 2
    assert "no such checkpoint or checkpoint folder" in capsys.readouterr().err


def test_a_latest_checkpoint_that_cannot_be_read_is_said(saves, tmp_path, capsys):
    folder = tmp_path / "saves"
    shutil.copytree(saves, folder)
    (folder / "step-00000002" / "manifest.json").write_text("{not json")
    assert main(["checkpoint", str(folder)]) == 2
    said = capsys.readouterr()
    assert "step-00000002: not loaded (" in said.out and "not valid JSON" in said.out
    assert "step-00000002, the checkpoint a resume would load, cannot be read" in said.err


@pytest.fixture(scope="module")
def example_saves(tmp_path_factory) -> Path:
    """A checkpoint of the example GPT (examples/gpt/zero3.yaml's model) on one rank."""
    from zerocc.compiler.plan import load_plan
    from zerocc.compiler.workload import load_workload

    root = tmp_path_factory.mktemp("example")
    plan = load_plan(EXAMPLE, ["backend.device=cpu"])
    workload = load_workload(plan)
    step = zerocc.compile(workload.model, plan, loss_fn=workload.loss_fn)
    step(*next(workload.batches(0, 1)))
    step.save(root)
    return root


def test_a_plan_that_resumes_the_checkpoint_is_told_what_it_does_otherwise(
    example_saves, capsys
):
    shown = ["checkpoint", str(example_saves), "--plan", str(EXAMPLE)]
    assert main(shown) == 0
    said = capsys.readouterr().out
    goes_on = "on 1 rank(s) resumes from it (its model and optimizer), and goes on as the run"
    assert f"{goes_on} that saved it would" in said
    assert main([*shown, "--world-size", "3", "--set", "zero.stage=1"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert len(notes) == 2, notes
    assert "saved at ZeRO stage 3, resharded for stage 1" in notes[0]
    assert "saved on 1 ranks, loaded on 3" in notes[1]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--set", "optimizer.name=sgd"], "--plan {}: the checkpoint's optimizer is adamw"),
        (["--set", "workload_args.n_layer=2"], "--plan {}: the checkpoint is of another model"),
        (["--world-size", "0"], "--world-size 0: at least 1"),
        (["--set", "zero.world_size=4", "--world-size", "3"], "the plan's zero.world_size is 4"),
    ],
    ids=["another-optimizer", "another-model", "no-ranks", "a-fixed-world"],
)
def test_a_plan_that_cannot_resume_the_checkpoint_is_told_why(
    example_saves, capsys, flags, said
):
    shown = ["checkpoint", str(example_saves), "--plan", str(EXAMPLE), *flags]
    assert main(shown) == 2
    assert said.format(example_saves / "step-00000001") in capsys.readouterr().err


def test_plan_flags_without_a_plan_are_refused(saves, capsys):
    assert main(["checkpoint", str(saves), "--world-size", "2"]) == 2
    assert "--set and --world-size go with --plan" in capsys.readouterr().err


def test_json_says_it_all_for_scripts(example_saves, capsys):
    shown = ["checkpoint", str(example_saves), "--json", "--verify", "--plan", str(EXAMPLE),
             "--world-size", "2"]  # fmt: skip
    assert main(shown) == 0
    said = json.loads(capsys.readouterr().out)
    (only,) = said["checkpoints"]
    assert only["name"] == "step-00000001" and only["step"] == 1 and only["latest"]
    assert only["world_size"] == 1 and only["stage"] == 3
    assert only["bytes"] == sum(p.stat().st_size for p in Path(only["folder"]).glob("rank-*"))
    assert said["shown"] == only["folder"] and said["other"] == []
    assert said["verified"]["chunks"] > 0 and said["verified"]["bytes"] == only["bytes"]
    assert said["resumes"]["world_size"] == 2
    assert [n[:25] for n in said["resumes"]["notes"]] == ["saved on 1 ranks, loaded "]
