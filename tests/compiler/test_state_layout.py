"""The state layout is an output of the passes (zerocc/compiler/state.py `StateLayout`): each pass
declares the state it creates or changes, the compiled program carries the layout, its state
placeholders bind exactly it, and the runtime allocates from the same fold of the passes'
declarations before anything is compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerocc
from zerocc.compiler.driver.pass_manager import bind_passes, plan_layout, state_layout
from zerocc.compiler.driver.program import check_bindings
from zerocc.compiler.state import DEVICE, HOST, NVME, StateLayout
from zerocc.errors import InvariantError
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import LOSS_SCALE_KEY, MASTER, OPTIM_STATE, STATE_ROLES, info, placeholders

PLANS = {
    "stage 0 fp32": {"zero": {"stage": 0}},
    "stage 1 bf16": {"zero": {"stage": 1}, "precision": {"param": "bf16"}},
    "stage 2 accumulated": {"zero": {"stage": 2}, "grad_accumulation": 2},
    "stage 3 fp16 scaled": {
        "zero": {"stage": 3},
        "precision": {"param": "fp16", "loss_scale": "dynamic"},
    },
    "stage 3 optimizer on host": {"zero": {"stage": 3}, "offload": {"optimizer": "cpu"}},
    "stage 3 params on NVMe": {
        "zero": {"stage": 3},
        "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": "/unused"},
    },
}


def _plan(**sections):
    return zerocc.load_plan(
        {"workload": "workload:workload", "units": {"classes": ["Block"]}, **sections}
    )


@pytest.mark.parametrize("name", list(PLANS))
def test_the_program_binds_the_layout_the_runtime_allocates(name):
    plan = _plan(**PLANS[name])
    inspection = inspect_plan(plan, 4)
    stepping = inspection.stepping
    allocated = state_layout(bind_passes(plan), inspection.units, plan)
    assert stepping.layout == allocated
    assert (LOSS_SCALE_KEY in allocated) == (plan.precision.scaling != "none")
    bound = {info(n).key for n in placeholders(stepping.gm) if info(n).role in STATE_ROLES}
    # The program that steps binds every state but those read through their NVMe files.
    assert bound == {s.key for s in allocated if s.location != NVME}
    for program in inspection.programs.values():  # an accumulating one binds a subset
        assert program.layout == allocated


def test_offload_moves_the_states_it_places_and_adds_a_master_where_the_update_runs():
    plan = _plan(zero={"stage": 3}, offload={"optimizer": "cpu"})
    inspection = inspect_plan(plan, 4)
    layout = inspection.stepping.layout
    moved = {s.key for s in layout if s.location == HOST}
    assert moved == {s.key for s in layout if s.role in (MASTER, OPTIM_STATE)}
    masters = [s for s in layout if s.role == MASTER]
    assert masters and all(s.dtype == torch.float32 for s in masters)  # fp32: placed only
    on_device = plan_layout(_plan(zero={"stage": 3}), inspection.units)
    assert not [s for s in on_device if s.role == MASTER]
    assert {s.location for s in on_device} == {DEVICE}


def test_a_placeholder_that_binds_no_declared_state_is_an_error():
    plan = _plan(zero={"stage": 3}, precision={"param": "bf16"})
    program = inspect_plan(plan, 4).stepping
    master = next(s for s in program.layout if s.role == MASTER)
    undeclared = StateLayout([s for s in program.layout if s.key != master.key])
    with pytest.raises(InvariantError, match="binds no state of the layout"):
        check_bindings(program.gm, undeclared)
    retyped = StateLayout(list(program.layout))
    retyped.declare(dataclasses.replace(master, dtype=torch.bfloat16))
    with pytest.raises(InvariantError, match=master.key.replace(".", r"\.")):
        check_bindings(program.gm, retyped)
