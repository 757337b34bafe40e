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
    step = zerocc.compile(tiny_gpt(), {"zero": {"stage": 3}, "backend": {"device": "cpu"}})
    step(*batch_of({"model": "gpt"}, 0, rank))
    try:
        step(*batch_of({"model": "gpt"}, 1, rank)[:1], torch.zeros(2 + rank, 8, dtype=torch.long))
    except RankMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_shapes_all_get_an_error():
    messages = run_ranks(2, _disagreeing_shapes, timeout=300)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}, step 2: the batch shapes differ across ranks")
        assert "rank 0:" in message and "rank 1:" in message


def test_triton_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plan = {"backend": {"kernels": "triton", "device": "cpu"}}
    with pytest.raises(NotSupportedError, match="TRITON_INTERPRET=1"):
        zerocc.compile(build("gpt"), plan)


def _linear_step(stage: int, accum: int = 1) -> zerocc.TrainStep:
    torch.manual_seed(0)
    plan = {"zero": {"stage": stage}, "grad_accumulation": accum}
    return zerocc.compile(torch.nn.Linear(4, 1), plan, loss_fn=lambda m, x: m(x).pow(2).mean())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_batch_of_another_dtype_is_a_clear_error_and_nothing_broken_is_kept(stage):
    step = _linear_step(stage)
    step(torch.ones(3, 4))
    before = step.full_state_dict()
    for _ in range(2):  # the failed program is not cached: the second try fails the same way
        with pytest.raises(zerocc.BatchError) as error:
            step(torch.ones(3, 4, dtype=torch.float64))
        message = str(error.value)
        assert "batch[0]: float64 tensor of shape (3, 4), earlier float32 tensor" in message
        assert "node addmm" in message and "mat1 and mat2 must have the same dtype" in message
        assert "not kept and nothing was updated" in message
    assert len(step.programs) == 1
    assert all(torch.equal(before[k], v) for k, v in step.full_state_dict().items())
    step(torch.ones(3, 4))  # the step goes on with batches it can take
    assert step.steps == 2


def test_a_failed_micro_batch_drops_its_accumulation_window():
    step = _linear_step(stage=2, accum=2)
    step(torch.ones(3, 4))  # accumulates
    with pytest.raises(zerocc.BatchError, match="the 1 micro-batch"):
        step(torch.ones(3, 4, dtype=torch.float64))
    assert step.micro_batches == 0
    grads = [t for k, t in step.state.items() if k.endswith(".grad")]
    assert grads and all(not g.any() for g in grads)
    clean = _linear_step(stage=2, accum=2)
    for s in (step, clean):
        s(torch.full((3, 4), 2.0))
        s(torch.full((3, 4), 3.0))
    expected = clean.full_state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in step.full_state_dict().items())
