"""TrainStep: program cache, checkpoints, full state dict, explain."""

from __future__ import annotations

import torch
from models import build
from parity import batch_of

import zerocc

PLAN = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "optimizer": {"eps": 1e-3}}


def _batch(i: int, size: int = 2):
    return (
        batch_of({"model": "gpt"}, i, 0)
        if size == 2
        else tuple(t[:size] for t in batch_of({"model": "gpt"}, i, 0))
    )


def test_programs_are_cached_by_batch_signature():
    step = zerocc.compile(build("gpt"), PLAN)
    step(*_batch(0))
    step(*_batch(1))
    assert len(step.programs) == 1
    step(*_batch(2, size=1))  # the short last batch of an epoch
    assert len(step.programs) == 2
    step(*_batch(3))
    assert len(step.programs) == 2


def test_full_state_dict_loads_strictly_into_a_fresh_model():
    step = zerocc.compile(build("gpt"), PLAN)
    step(*_batch(0))
    fresh = build("gpt")
    fresh.load_state_dict(step.full_state_dict(), strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    loss = fresh(*_batch(1))
    assert torch.allclose(loss, step(*_batch(1)), rtol=1e-6)


def test_checkpoint_resumes_exactly():
    straight = zerocc.compile(build("gpt"), PLAN)
    losses = [float(straight(*_batch(i))) for i in range(4)]
    first = zerocc.compile(build("gpt"), PLAN)
    for i in range(2):
        first(*_batch(i))
    saved = first.state_dict()
    resumed = zerocc.compile(build("gpt"), PLAN)
    resumed.load_state_dict(saved)
    assert [float(resumed(*_batch(i))) for i in (2, 3)] == losses[2:]


def test_explain_shows_units_comm_and_formula():
    step = zerocc.compile(
        build("odd"), {"zero": {"stage": 2}, "units": {"modules": ["a"]}}, comm=zerocc.FakeComm(4)
    )
    step(*batch_of({"model": "odd"}, 0, 0))
    text = step.explain()
    assert "ZeRO stage 2, world size 4, 2 units" in text
    assert "reduce_scatter" in text and "all_gather" in text
    assert "ZeRO formula" in text and "optimizer" in text
