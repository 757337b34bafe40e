"""Sharded checkpoints through torch.distributed.checkpoint: resume gives the same numbers."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp
from models import build
from multirank import run_ranks
from parity import batch_of

import zerocc
from zerocc.errors import RankMismatchError

PLAN = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "optimizer": {"eps": 1e-3}}


def _losses(step, rank: int, indices) -> list[float]:
    return [float(step(*batch_of({"model": "gpt"}, i, rank))) for i in indices]


def _resume(rank: int, world: int, path: str, stage: int) -> tuple[list[float], list[float]]:
    plan = {**PLAN, "zero": {"stage": stage}}
    straight = _losses(zerocc.compile(build("gpt"), plan), rank, range(4))
    first = zerocc.compile(build("gpt"), plan)
    _losses(first, rank, range(2))
    dcp.save(first.state_dict(), checkpoint_id=path)
    resumed = zerocc.compile(build("gpt", seed=123), plan)  # other weights until loaded
    sd = resumed.state_dict()
    dcp.load(sd, checkpoint_id=path)
    resumed.load_state_dict(sd)
    return straight[2:], _losses(resumed, rank, (2, 3))


@pytest.mark.parametrize("stage", [1, 3])
def test_dcp_save_and_load_resume_exactly_on_two_ranks(tmp_path, stage):
    for straight, resumed in run_ranks(2, _resume, str(tmp_path / "ckpt"), stage, timeout=300):
        assert resumed == straight


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_in_one_process(tmp_path):
    straight, resumed = _resume(0, 1, str(tmp_path / "ckpt"), 2)
    assert resumed == straight


def test_checkpoint_of_another_stage_is_refused():
    saved = zerocc.compile(build("gpt"), PLAN).state_dict()
    other = zerocc.compile(build("gpt"), {**PLAN, "zero": {"stage": 2}})
    with pytest.raises(RankMismatchError, match="stage=3, this run has stage=2"):
        other.load_state_dict(saved)
