"""The optimizer pass (zerocc/compiler/passes/optimizer.py) and the gradient pass it reads
(zerocc/compiler/passes/support/gradients.py), graph-level on four simulated ranks: one update per
trainable unit where a program steps, none where it only accumulates, one reduction per unit as
its stage prescribes, gradient state only where micro-batches accumulate."""

from __future__ import annotations

import pytest

import zerocc
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import GRAD, info, op_name, placeholders


def _programs(stage: int, **plan) -> tuple[dict, list]:
    plan = {
        "workload": "workload:workload",
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        **plan,
    }
    inspection = inspect_plan(zerocc.load_plan(plan), 4)
    programs = {boundary: p.gm for boundary, p in inspection.programs.items()}
    return programs, [u.name for u in inspection.units if u.trainable]


def _ops(gm, name: str) -> list:
    return [n for n in gm.graph.nodes if op_name(n.target) == f"zerocc.{name}"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_update_per_trainable_unit(stage, optimizer):
    programs, trainable = _programs(stage, optimizer={"name": optimizer})
    updates = _ops(programs[True], f"{optimizer}_")
    assert sorted(info(n).unit for n in updates) == sorted(trainable)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_accumulating_program_updates_nothing_and_keeps_gradient_state(stage):
    programs, trainable = _programs(stage, grad_accumulation=2)
    accumulate = programs[False]
    assert not _ops(accumulate, "adamw_") and not _ops(accumulate, "clip_coef")
    kept = sorted(info(n).unit for n in placeholders(accumulate, GRAD))
    assert kept == sorted(trainable)


def test_without_accumulation_no_gradient_outlives_its_step():
    programs, _ = _programs(2)
    assert not placeholders(programs[True], GRAD)


@pytest.mark.parametrize(
    "stage, reduction",
    [(0, "all_reduce_start"), (2, "reduce_scatter_start"), (3, "reduce_scatter_start")],
)
def test_one_gradient_reduction_per_unit_of_its_stage(stage, reduction):
    programs, trainable = _programs(stage, overlap={"bucket_mb": 0})
    reduced = [n for n in _ops(programs[True], reduction) if info(n).phase == "backward"]
    assert sorted(info(n).unit for n in reduced) == sorted(trainable)


@pytest.mark.parametrize("stage", [2, 3])
def test_units_are_updated_in_the_order_backward_reduces_their_gradients(stage):
    """So that a host update (offload), whose gradient is copied out as soon as it is reduced,
    waits for its own copy only, not for the copies queued before it."""
    programs, _ = _programs(stage, overlap={"bucket_mb": 0})
    reduced = [n for n in _ops(programs[True], "reduce_scatter_start")]
    updates = _ops(programs[True], "adamw_")
    assert [info(n).unit for n in updates] == [info(n).unit for n in reduced]
    assert info(updates[0]).unit != "root"  # forward's first unit completes last


def test_clipping_and_the_nonfinite_check_read_every_gradient_once():
    programs, _ = _programs(3, optimizer={"grad_clip": 1.0})
    step = programs[True]
    assert len(_ops(step, "nonfinite_flags")) == 1 and len(_ops(step, "clip_coef")) == 1
