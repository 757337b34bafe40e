"""gloo's own buffers in the memory prediction (``comm``, see zerocc.cost.memory): a CPU run's
all-gathers and reduce-scatters go through a flat tensor gloo allocates, the whole size they
move, which the program's values do not show."""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt
from multirank import run_ranks

import zerocc
from zerocc.cost.memory import predict_memory
from zerocc.runtime import memory_check
from zerocc.runtime.allocations import peak_allocated
from zerocc.runtime.machine_memory import HOST_POOL

CPU = torch.device("cpu")


def _plan(stage: int) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "backend": {"name": "eager", "device": "cpu"},
    }


def _program(stage: int):
    torch.manual_seed(0)
    step = zerocc.compile(tiny_gpt(), _plan(stage), comm=zerocc.FakeComm(world_size=2))
    step(*_gpt_batch(0, 0))
    return step.program


def test_gloo_holds_what_a_gather_or_a_reduction_moves_and_nothing_for_an_all_reduce():
    stage_3 = predict_memory(_program(3), {}, gloo=True).series["comm"]
    largest_unit = 4 * sum(p.numel() for p in tiny_gpt().transformer.h[0].parameters())
    assert max(stage_3) >= largest_unit  # (padded to the ranks: at least the unit)
    assert not any(predict_memory(_program(3), {}).series["comm"])  # NCCL's are not tensors
    assert not any(predict_memory(_program(0), {}, gloo=True).series["comm"])  # in place


def test_the_memory_check_counts_gloos_buffers_for_ranks_on_gloo():
    gm = _program(3)
    on_gloo = memory_check.step_need(gm, CPU, gloo=True)[HOST_POOL]
    assert on_gloo["collective buffers"] > 0
    assert memory_check.step_need(gm, CPU, gloo=False)[HOST_POOL]["collective buffers"] == 0


def _measured_and_predicted(rank: int, world: int) -> dict[int, tuple[int, int, int]]:
    """Per stage: the most tensor memory 5 steps allocated beyond what was live before each
    (the allocator's, gloo's thread included), and the peak predicted with and without gloo's
    buffers."""
    return {stage: _one_stage(rank, stage) for stage in (2, 3)}


def _one_stage(rank: int, stage: int) -> tuple[int, int, int]:
    torch.manual_seed(0)
    step = zerocc.compile(tiny_gpt(), _plan(stage))
    assert step.comm.on_gloo
    for i in range(2):
        step(*_gpt_batch(i, rank))
    batches = [_gpt_batch(2 + i, rank) for i in range(5)]
    measured = max(peak_allocated(lambda b=b: step(*b), CPU)[1] for b in batches)
    with_gloo, without = (predict_memory(step.program, {}, gloo=g).peak()[1] for g in (True, False))
    return measured, with_gloo, without


@pytest.fixture(scope="module")
def two_gloo_ranks() -> list[dict[int, tuple[int, int, int]]]:
    return run_ranks(2, _measured_and_predicted, timeout=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_what_gloo_ranks_allocate_stays_within_the_prediction(two_gloo_ranks, stage):
    """The prediction holds each buffer from its collective's start to its wait: an upper
    bound (gloo holds it while the collective runs). 1% over it is allowed: the few hundred
    bytes of scalars made outside the program (as tests/backends/test_inductor.py measures;
    stage 0, without buffers, is 0.6% over). Measured 2026-12-02: stage 3 0.3% over the
    bound; stage 2 15% under it (its reductions run in a fraction of the window)."""
    for measured, predicted, _ in (rank[stage] for rank in two_gloo_ranks):
        assert measured <= predicted * 1.01, (measured, predicted)


def test_without_gloos_buffers_the_prediction_of_stage_3_falls_short(two_gloo_ranks):
    """What the category mends: the program's values alone were 7-19% under what stage 3
    allocated on gloo ranks (its gathered units are prefetched, so one is in flight while the
    step peaks). gloo's thread takes the buffer when it runs the gather: the most of 10 steps
    (5 on each rank) is held to it, each of the 12 measured so far was over."""
    measured = max(rank[3][0] for rank in two_gloo_ranks)
    without = two_gloo_ranks[0][3][2]
    assert measured > without * 1.05, (measured, without)
