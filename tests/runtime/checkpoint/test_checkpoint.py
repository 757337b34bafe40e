"""Sharded checkpoints through torch.distributed.checkpoint: resume gives the same numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import build
from multirank import run_ranks
from parity import batch_of

import zerocc
from zerocc.errors import CheckpointError, RankMismatchError

PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "optimizer": {"eps": 1e-3},
    "backend": {"device": "cpu"},
}


def _losses(step, rank: int, indices) -> list[float]:
    return [float(step(*batch_of({"model": "gpt"}, i, rank))) for i in indices]


def _resume(
    rank: int, world: int, path: str, stage: int, precision: dict | None = None
) -> tuple[list[float], list[float]]:
    plan = {**PLAN, "zero": {"stage": stage}, "precision": precision or {}}
    straight = zerocc.compile(build("gpt"), plan)
    straight_losses = _losses(straight, rank, range(4))
    first = zerocc.compile(build("gpt"), plan)
    _losses(first, rank, range(2))
    dcp.save(first.state_dict(), checkpoint_id=path)
    resumed = zerocc.compile(build("gpt", seed=123), plan)  # other weights until loaded
    sd = resumed.state_dict()
    dcp.load(sd, checkpoint_id=path)
    resumed.load_state_dict(sd)
    resumed_losses = _losses(resumed, rank, (2, 3))
    assert (resumed.loss_scale, resumed.skipped_steps, resumed.steps) == (
        straight.loss_scale,
        straight.skipped_steps,
        straight.steps,
    )
    return straight_losses[2:], resumed_losses


@pytest.mark.parametrize("stage", [1, 3])
def test_dcp_save_and_load_resume_exactly_on_two_ranks(tmp_path, stage):
    for straight, resumed in run_ranks(2, _resume, str(tmp_path / "ckpt"), stage, timeout=300):
        assert resumed == straight


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("precision", [None, {"param": "fp16", "dynamic": {"hysteresis": 1}}])
def test_dcp_in_one_process(tmp_path, precision):
    """fp16: the first step overflows, so the loss scale and skip count must come back too."""
    straight, resumed = _resume(0, 1, str(tmp_path / "ckpt"), 2, precision)
    assert resumed == straight


def test_checkpoint_of_another_stage_is_refused():
    saved = zerocc.compile(build("gpt"), PLAN).state_dict()
    other = zerocc.compile(build("gpt"), {**PLAN, "zero": {"stage": 2}})
    with pytest.raises(RankMismatchError, match="stage=3, this run has stage=2"):
        other.load_state_dict(saved)


def _save_twice(rank: int, world: int, folder: str) -> None:
    step = zerocc.compile(build("gpt"), PLAN)
    for i in range(2):
        _losses(step, rank, [i])
        step.save(folder)


def _load_own_copy(rank: int, world: int, root: str) -> tuple[str, bool]:
    """Rank ``rank`` loads its own copy of the checkpoints (``root``/rank<r>), as from a host's
    disk; returns the error and whether its weights stayed as they were."""
    step = zerocc.compile(build("gpt", seed=123), PLAN)
    before = {k: v.clone() for k, v in step.full_state_dict().items()}
    try:
        step.load(f"{root}/rank{rank}")
    except CheckpointError as exc:
        after = step.full_state_dict()
        return str(exc), all(torch.equal(v, after[k]) for k, v in before.items())
    return "", False


def test_ranks_that_find_different_checkpoints_load_none(tmp_path):
    """Each rank resolves the folder itself: where a host's copy lacks the newest checkpoint,
    every rank refuses, naming what each found, and nothing is loaded."""
    run_ranks(2, _save_twice, str(tmp_path / "saved"), timeout=300)
    for rank in range(2):
        shutil.copytree(tmp_path / "saved", tmp_path / f"rank{rank}")
    shutil.rmtree(tmp_path / "rank1" / "step-00000002")  # rank 1's host has only the first
    (tmp_path / "rank1" / "latest").unlink()
    for error, unchanged in run_ranks(2, _load_own_copy, str(tmp_path), timeout=300):
        assert "the ranks found different checkpoints" in error, error
        assert (
            "rank 0: step-00000002 (manifest" in error
            and "rank 1: step-00000001 (manifest" in error
        )
        assert unchanged


def _save_on_own_disk(rank: int, world: int, root: str) -> tuple[str, list[str]]:
    """Rank 1 writes its file under ``root``/host1, as into a folder of the same name on its
    own host's disk; returns the second save's error and the checkpoints rank 0's folder holds."""
    from zerocc.runtime.checkpoint import save

    step = zerocc.compile(build("gpt"), PLAN)
    _losses(step, rank, [0])
    step.save(f"{root}/shared")  # the first save: every file where rank 0 sees it
    if rank == 1:
        writer = save.DataWriter

        def on_own_disk(path):
            own = Path(root) / "host1" / path.relative_to(root)
            own.parent.mkdir(parents=True, exist_ok=True)
            return writer(own)

        save.DataWriter = on_own_disk
    _losses(step, rank, [1])
    try:
        step.save(f"{root}/shared")
    except CheckpointError as exc:
        return str(exc), sorted(p.name for p in Path(f"{root}/shared").glob("step-*"))
    return "", []


def test_a_checkpoint_folder_that_is_not_shared_fails_the_save(tmp_path):
    """Where a rank's file lands on its own host's disk, rank 0 does not see it: the save
    fails on every rank, naming the file, and the earlier checkpoint stays the newest."""
    for error, saved in run_ranks(2, _save_on_own_disk, str(tmp_path), timeout=300):
        assert "rank 0 does not see rank 1's file as written" in error, error
        assert "no such file" in error and "shared filesystem" in error
        assert saved == ["step-00000001"]
