"""A checkpoint folder is never silently mixed (issue 77): a save's ``keep`` deletes only
checkpoints older than the one it saves, ``latest`` names only a checkpoint that is there (a
resume of a folder whose ``latest`` names none refuses by name), and a run is told which of
its save folder's checkpoints are not its own before it starts."""

from __future__ import annotations

import pytest
from models import build
from parity import batch_of

import zerocc
from zerocc.runtime.checkpoint import CheckpointError, resolve
from zerocc.runtime.checkpoint.save_folder import (
    mixed_checkpoints,
    refusal,
    replace_checkpoints,
)

CASE = {"model": "gpt"}
PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "backend": {"device": "cpu", "kernels": "torch"},
}


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def another_run(tmp_path):
    """A folder of another run's checkpoints: steps 2, 3 and 4 (keep 3)."""
    step = zerocc.compile(build("gpt"), PLAN)
    for i in range(4):
        step(*batch_of(CASE, i, 0))
        step.save(tmp_path, keep=3)
    assert _names(tmp_path) == ["latest", "step-00000002", "step-00000003", "step-00000004"]
    return tmp_path


def test_keep_never_deletes_the_checkpoint_it_saves(another_run):
    """A new run saves step 1 into the folder with keep 3: its save is kept (it was the
    oldest by name, so it was deleted, and `latest` named it), the later ones are not its to
    delete, and the folder resolves to the save just made."""
    step = zerocc.compile(build("gpt"), PLAN)
    step(*batch_of(CASE, 0, 0))
    saved = step.save(another_run, keep=3)
    assert saved.is_dir() and saved.name == "step-00000001"
    assert (another_run / "latest").read_text().strip() == "step-00000001"
    assert resolve(another_run) == saved
    assert "step-00000004" in _names(another_run)


def test_keep_counts_the_new_save_and_those_older_than_it(tmp_path):
    step = zerocc.compile(build("gpt"), PLAN)
    for i in range(4):
        step(*batch_of(CASE, i, 0))
        step.save(tmp_path, keep=2)
    assert _names(tmp_path) == ["latest", "step-00000003", "step-00000004"]


def test_a_latest_that_names_a_checkpoint_not_there_is_refused_by_name(another_run):
    """`latest` names a deleted checkpoint: a resume of the folder refused naming it and what
    the folder holds, not the newest loaded in its place (it was another run's)."""
    (another_run / "latest").write_text("step-00000001\n")
    said = (
        f"{another_run / 'latest'} names step-00000001, which is not there (deleted since it "
        "was saved): name the checkpoint to load (it holds step-00000002, step-00000003, "
        "step-00000004)"
    )
    with pytest.raises(CheckpointError) as refused:
        resolve(another_run)
    assert str(refused.value) == said
    step = zerocc.compile(build("gpt"), PLAN)
    with pytest.raises(CheckpointError, match="names step-00000001, which is not there"):
        step.load(another_run)
    assert step.steps == 0


def test_a_folder_without_latest_resolves_to_its_newest(another_run):
    (another_run / "latest").unlink()
    assert resolve(another_run) == another_run / "step-00000004"


def test_a_run_is_told_which_checkpoints_of_its_save_folder_are_not_its_own(another_run):
    """Without a resume all of them are another run's; resumed from one there, those later
    than it; resumed from its newest (or the folder), none."""
    mixed = mixed_checkpoints(another_run, None)
    assert [p.name for p in mixed.stale] == ["step-00000002", "step-00000003", "step-00000004"]
    assert str(refusal(mixed, "--save")) == (
        f"--save {another_run} holds checkpoints of another run (step-00000002, step-00000003, "
        f"step-00000004): this run's saves would mix with them. Go on from them with --resume "
        f"{another_run}, replace them with --overwrite, or save to another folder"
    )
    later = mixed_checkpoints(another_run, another_run / "step-00000002")
    assert [p.name for p in later.stale] == ["step-00000003", "step-00000004"]
    assert str(refusal(later, "checkpoint.dir")).startswith(
        f"checkpoint.dir {another_run} holds step-00000003, step-00000004, later than "
        "step-00000002 this run resumes from: its saves would mix with them."
    )
    assert mixed_checkpoints(another_run, another_run) is None
    assert mixed_checkpoints(another_run, another_run / "step-00000004") is None
    assert mixed_checkpoints(another_run / "nowhere", None) is None


def test_overwrite_deletes_only_what_is_not_the_runs_own(another_run):
    (another_run / ".step-00000005.partial").mkdir()
    (another_run / "notes.txt").write_text("the user's")
    replace_checkpoints(mixed_checkpoints(another_run, another_run / "step-00000003"))
    assert _names(another_run) == ["latest", "notes.txt", "step-00000002", "step-00000003"]
    assert resolve(another_run) == another_run / "step-00000003"  # (latest named it)
    replace_checkpoints(mixed_checkpoints(another_run, None))
    assert _names(another_run) == ["notes.txt"]
