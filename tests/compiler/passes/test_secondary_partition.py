"""The secondary partition (``zero.secondary_group: G``, ZeRO++'s hpZ) in the stage-3 program:
forward gathers each unit over the shard group and keeps this rank's 1/G of it, backward
gathers it over the ``secondary`` group from those parts, the memory the parts hold is in the
prediction, and the plans it cannot apply to are clear errors. (Its parity with unsharded
training: tests/parity/test_secondary_partition_parity.py.)"""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt

from zerocc.compiler.plan import load_plan
from zerocc.compiler.workload import Workload
from zerocc.cost.memory import predict_memory
from zerocc.errors import PlanError
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name, val
from zerocc.ir.ops import PARAM_GATHERS

WORLD, G = 4, 2


def _plan(**zero) -> dict:
    return {
        "zero": {"stage": 3, **zero},
        "units": {"classes": ["Block"]},
        "backend": {"device": "cpu"},
    }


def _program(**zero):
    torch.manual_seed(0)
    workload = Workload(tiny_gpt(), batches=lambda rank, world: iter([_gpt_batch(0, rank)]))
    return inspect_plan(_plan(**zero), WORLD, workload).stepping


def _gathers(gm) -> list[tuple[str, str, int]]:
    """(phase, group, elements gathered) of each parameter gather, in program order."""
    return [
        (info(n).phase, n.args[-1], val(n.args[0]).numel())
        for n in gm.graph.nodes
        if n.op == "call_function" and op_name(n.target) in PARAM_GATHERS
    ]


def test_backward_gathers_each_unit_over_its_secondary_group_from_forwards_parts():
    plain, hpz = _program(), _program(secondary_group=G)
    before, after = _gathers(plain.gm), _gathers(hpz.gm)
    forward = [g for g in before if g[0] == "forward"]
    assert [g for g in after if g[0] == "forward"] == forward  # over dp, from the shards
    assert {g[1] for g in before if g[0] == "backward"} == {"dp"}
    # from each unit's part: 1/G of its flat, WORLD/G shards (of 1/WORLD each)
    shards = [n for _, _, n in backward_of(before)]
    assert backward_of(after) == [("backward", "secondary", WORLD // G * n) for n in shards]
    # the parts live from forward to backward, in the gathered units' memory
    peak = predict_memory(hpz.gm, {}).peak()[1] - predict_memory(plain.gm, {}).peak()[1]
    assert 0 < peak <= sum(WORLD // G * n * 4 for n in shards)


def backward_of(gathers: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    return [g for g in gathers if g[0] == "backward"]


def test_quantized_forward_gathers_leave_backward_to_the_secondary_group():
    """With 8-bit weights, backward gathers the dequantized values forward computed with."""
    gm = _program(secondary_group=G, quantized_weights="fp8").gm
    ops = {(info(n).phase, op_name(n.target)) for n in gm.graph.nodes if n.op == "call_function"}
    assert ("forward", "zerocc.all_gather_quantized_start") in ops
    assert ("backward", "zerocc.all_gather_quantized_start") not in ops
    assert {g[1] for g in backward_of(_gathers(gm))} == {"secondary"}


@pytest.mark.parametrize(
    ("zero", "world", "parallel", "said"),
    [
        ({"stage": 2, "secondary_group": 2}, 4, {}, "stage 2 gathers none"),
        ({"stage": 3, "secondary_group": 4}, 4, {}, "allowed: 2"),
        ({"stage": 3, "secondary_group": 3}, 4, {}, "must divide the shard group of 4"),
        ({"stage": 3, "secondary_group": 2, "replicate": 2}, 4, {}, "allowed: none"),
        ({"stage": 3, "secondary_group": 2}, 8, {"pp": 2}, "with parallel.pp: 2"),
    ],
)
def test_plans_it_cannot_apply_to_are_errors(zero, world, parallel, said):
    with pytest.raises(PlanError, match=said):
        load_plan({"zero": zero, "parallel": parallel}).check_world_size(world)
