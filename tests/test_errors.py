"""Bad input gives a clear error before anything hangs: plans, units, world sizes, losses, ranks."""

from __future__ import annotations

import pytest
import torch
from models import build, tiny_gpt
from multirank import run_ranks
from parity import batch_of

import zerocc
from zerocc.errors import (
    CaptureError,
    NotSupportedError,
    PassOrderError,
    PlanError,
    RankMismatchError,
)


def test_invalid_plan_names_the_field():
    with pytest.raises(PlanError, match=r"zero\.stage"):
        zerocc.compile(tiny_gpt(), {"zero": {"stage": 5}})


def test_unit_pattern_that_matches_nothing_fails_at_compile():
    with pytest.raises(PlanError, match=r"units\.modules: pattern 'blocks\.\*' matches no module"):
        zerocc.compile(tiny_gpt(), {"units": {"modules": ["blocks.*"]}})
    with pytest.raises(PlanError, match=r"units\.classes: no module of class 'Blok'"):
        zerocc.compile(tiny_gpt(), {"units": {"classes": ["Blok"]}})


def test_world_size_the_plan_cannot_serve():
    with pytest.raises(PlanError, match=r"zero\.world_size: the plan expects 4 ranks.* has 1"):
        zerocc.compile(tiny_gpt(), {"zero": {"world_size": 4}})


def test_non_scalar_loss():
    step = zerocc.compile(build("odd"), {}, loss_fn=lambda m, x, y: m.c(x @ torch.ones(5, 13)))
    with pytest.raises(CaptureError, match="scalar"):
        step(*batch_of({"model": "odd"}, 0, 0))


def test_loss_that_is_not_a_tensor():
    step = zerocc.compile(build("odd"), {}, loss_fn=lambda m, x, y: 1.0)
    with pytest.raises(CaptureError, match="got float"):
        step(*batch_of({"model": "odd"}, 0, 0))


def test_pass_order_is_checked_before_anything_runs():
    with pytest.raises(PassOrderError, match="'shard' requires 'units' .*produced by partition"):
        zerocc.compile(tiny_gpt(), {"passes": ["shard", "partition", "optimizer"]})
    with pytest.raises(PlanError, match=r"passes\[1\]: unknown pass 'shrad'"):
        zerocc.compile(tiny_gpt(), {"passes": ["partition", "shrad"]})


def _disagreeing_shapes(rank: int, world: int) -> str:
    step = zerocc.compile(tiny_gpt(), {"zero": {"stage": 3}})
    step(*batch_of({"model": "gpt"}, 0, rank))
    try:
        step(*batch_of({"model": "gpt"}, 1, rank)[:1], torch.zeros(2 + rank, 8, dtype=torch.long))
    except RankMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_shapes_all_get_an_error():
    messages = run_ranks(2, _disagreeing_shapes, timeout=300)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: the batch shapes differ across ranks")
        assert "rank 0:" in message and "rank 1:" in message


def test_triton_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plan = {"backend": {"kernels": "triton", "device": "cpu"}}
    with pytest.raises(NotSupportedError, match="TRITON_INTERPRET=1"):
        zerocc.compile(build("gpt"), plan)
