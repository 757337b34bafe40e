"""Graph-level tests of the shard and optimizer passes, on a fake process group (no ranks)."""

from __future__ import annotations

import pytest
from models import build, tiny_gpt
from parity import batch_of

import zerocc
from zerocc.ir.nodes import info, op_name


def compiled(stage: int, world: int = 4, accum: int = 1, calls: int = 1, model=None):
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "grad_accumulation": accum,
        "optimizer": {"grad_clip": 1.0},
        "overlap": {"enabled": False},  # the shard pass's schedule, as it emits it
    }
    step = zerocc.compile(model or tiny_gpt(), plan, comm=zerocc.FakeComm(world))
    for i in range(calls):
        step(*batch_of({"model": "gpt"}, i, 0))
    return step


def ops(step, name: str, phase: str | None = None):
    return [
        n
        for n in step.program.graph.nodes
        if op_name(n.target) == f"zerocc.{name}" and (phase is None or info(n).phase == phase)
    ]


def position(step):
    return {n: i for i, n in enumerate(step.program.graph.nodes)}


def test_stage3_gathers_each_unit_once_per_phase_and_frees_it():
    step = compiled(3)
    units = [u.name for u in step.units]
    for phase in ("forward", "backward"):
        gathered = [info(n).unit for n in ops(step, "all_gather_start", phase)]
        freed = [info(n).unit for n in ops(step, "free", phase)]
        assert sorted(gathered) == sorted(units) and sorted(freed) == sorted(units)
    at = position(step)
    for unit in units:

        def where(name, phase, unit=unit):
            return next(at[n] for n in ops(step, name, phase) if info(n).unit == unit)

        assert (
            where("all_gather_start", "forward")
            < where("free", "forward")
            < where("all_gather_start", "backward")
            < where("free", "backward")
        )
    assert [info(n).unit for n in ops(step, "reduce_scatter_start")] == [
        "transformer.h.1",
        "transformer.h.0",
        "root",
    ]  # in the order gradients complete
    assert not ops(step, "all_reduce_start", "backward")


def test_stage3_forward_gather_comes_right_before_the_units_first_use():
    step = compiled(3)
    nodes = list(step.program.graph.nodes)
    for start in ops(step, "all_gather_start", "forward"):
        wait = next(iter(start.users))
        first_use = next(
            n
            for n in nodes[nodes.index(wait) + 1 :]
            if info(n).unit == info(wait).unit and wait in n.all_input_nodes
        )
        between = nodes[nodes.index(wait) + 1 : nodes.index(first_use)]
        assert not any(
            op_name(n.target).startswith("aten.") and info(n).unit is None for n in between
        )


def test_stage2_reduce_scatters_in_backward_and_gathers_updated_params():
    step = compiled(2)
    assert not ops(step, "all_gather_start")
    assert len(ops(step, "reduce_scatter_start", "backward")) == len(step.units)
    at = position(step)
    for update in ops(step, "adamw_"):
        gather = next(
            n for n in ops(step, "all_gather_into_start") if info(n).unit == info(update).unit
        )
        assert at[update] < at[gather]


def test_stage1_reduces_once_after_the_last_backward_op():
    """With accumulation: the full gradient accumulates over micro-batches, and is reduced once
    on the micro-batch that steps."""
    step = compiled(1, accum=2, calls=2)
    nodes = list(step.program.graph.nodes)
    # Captured backward ops carry no unit; what the shard pass adds (accumulation) does.
    last_backward = max(
        i for i, n in enumerate(nodes) if info(n).phase == "backward" and info(n).unit is None
    )
    scatters = ops(step, "reduce_scatter_start")
    assert len(scatters) == len(step.units)
    assert all(nodes.index(n) > last_backward for n in scatters)
    assert len(ops(step, "all_gather_into_start")) == len(step.units)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_without_accumulation_the_reduced_gradient_goes_straight_to_the_update(stage):
    """grad_accumulation 1: no gradient state, no add into it, no zeroing of it; each unit's
    gradient is packed once complete, reduced, and the collective's result is what its update
    reads (stage 1 reduces as stage 2 does: the full gradient never exists as a whole)."""
    step = compiled(stage)
    assert not [k for k in step.state if k.endswith(".grad")]
    graph = step.program.graph
    assert not [n for n in graph.nodes if op_name(n.target) in ("aten.add_", "aten.zero_")]
    reduce = "all_reduce_start" if stage == 0 else "reduce_scatter_start"
    reductions = ops(step, reduce, "backward")
    assert [op_name(n.args[0].target) for n in reductions] == ["zerocc.pack"] * len(step.units)
    waits = {next(iter(n.users)) for n in reductions}
    assert {n.args[1] for n in ops(step, "adamw_")} == waits
    # Reduced as each unit's gradient completes, not after backward.
    nodes = list(graph.nodes)
    last_backward = max(
        i for i, n in enumerate(nodes) if info(n).phase == "backward" and info(n).unit is None
    )
    assert nodes.index(reductions[0]) < last_backward


def test_stage0_all_reduces_and_updates_full_params():
    step = compiled(0)
    assert len(ops(step, "all_reduce_start", "backward")) == len(step.units)
    assert not ops(step, "all_gather_start") and not ops(step, "all_gather_into_start")


@pytest.mark.parametrize("stage,collectives", [(0, 0), (1, 0), (2, 3), (3, 9)])
def test_accumulating_micro_batch_has_no_update(stage, collectives):
    step = compiled(stage, accum=2)  # one call: a micro-batch that does not step
    assert not ops(step, "adamw_")
    starts = [n for n in step.program.graph.nodes if op_name(n.target).endswith("_start")]
    assert len(starts) == collectives


def test_grad_norm_is_all_reduced_only_when_gradients_are_sharded():
    assert not ops(compiled(0), "all_reduce_start", "optimizer")
    assert len(ops(compiled(3), "all_reduce_start", "optimizer")) == 1


def test_frozen_unit_is_gathered_but_gets_no_gradient_comm_or_optimizer_state():
    plan = {"zero": {"stage": 3}, "units": {"modules": ["backbone", "adapter"]}}
    step = zerocc.compile(build("frozen"), plan, comm=zerocc.FakeComm(2))
    step(*batch_of({"model": "frozen"}, 0, 0))
    frozen = "backbone[frozen]"
    assert frozen in {info(n).unit for n in ops(step, "all_gather_start", "forward")}
    assert frozen not in {info(n).unit for n in ops(step, "reduce_scatter_start")}
    assert frozen not in {info(n).unit for n in ops(step, "adamw_")}
    assert not any(k.startswith(frozen) and not k.endswith(".param") for k in step.state)


def test_module_called_twice_is_gathered_once_per_phase():
    plan = {"zero": {"stage": 3}, "units": {"modules": ["shared", "middle"]}}
    step = zerocc.compile(build("twice"), plan, comm=zerocc.FakeComm(2))
    step(*batch_of({"model": "twice"}, 0, 0))
    shared = [n for n in ops(step, "all_gather_start") if info(n).unit == "shared"]
    assert [info(n).phase for n in shared] == ["forward", "backward"]


def test_program_prints_as_readable_python_with_units_and_streams():
    text = zerocc.ir.printing.format_program(compiled(3).program, "after shard")
    assert text.startswith("# after shard\ndef program(")
    assert "zerocc.all_gather_start(" in text and "stream=comm" in text
    assert "unit=transformer.h.0" in text
