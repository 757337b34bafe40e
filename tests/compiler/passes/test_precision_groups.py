"""The precision pass (zerocc/compiler/passes/precision.py) agrees the loss scale's overflow
flag over the groups the mesh says a unit's gradient lies over (``Mesh.gradient_groups``), as
the optimizer pass sums its checks, instead of naming dp, tp and pp itself: an experts unit's
gradient on the other ep ranks (stage 0) or on the other replicas (hybrid sharding) is agreed
too, so that an overflow in one rank's experts is skipped by every rank."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from models import EP_MODELS, GPT, tiny_gpt
from parity import batch_of

import zerocc
from zerocc.compiler.passes import precision
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name

FP16 = {"param": "fp16"}


def _flag_groups(plan: dict, world: int, model: torch.nn.Module, units: dict) -> list[str]:
    """The groups of the stepping program's all-reduces of the overflow flag, in order."""
    plan = {"units": units, "precision": FP16, "backend": {"device": "cpu"}, **plan}
    kind = "gpt" if isinstance(model, GPT) else "one_sided_moe"

    def batches(rank: int, world: int):
        while True:
            yield batch_of({"model": kind}, 0, rank)

    workload = zerocc.Workload(model, batches=batches)
    gm = inspect_plan(zerocc.load_plan(plan), world, workload).stepping.gm
    return [
        n.args[1]
        for n in gm.graph.nodes
        if op_name(n.target) == "zerocc.all_reduce_start"
        and "overflow flag" in (info(n).note or "")
    ]


def _moe(plan: dict, world: int = 4) -> list[str]:
    build, _, units = EP_MODELS["one_sided_moe"]
    torch.manual_seed(0)
    return _flag_groups(plan, world, build(), units)


@pytest.mark.parametrize(
    ("plan", "groups"),
    [
        # stage 0: each ep rank checked its own experts' gradients; nothing else is in parts
        ({"zero": {"stage": 0}, "parallel": {"ep": 2}}, ["ep"]),
        # hybrid: the experts' shards on the other replica (their edp ranks span replicas)
        ({"zero": {"stage": 2, "replicate": 2}, "parallel": {"ep": 2}}, ["dp", "replicate"]),
        # sharded without replicas: the dp group holds every expert's shards
        ({"zero": {"stage": 3}, "parallel": {"ep": 2}}, ["dp"]),
    ],
    ids=["ep stage 0", "ep hybrid", "ep stage 3"],
)
def test_an_experts_overflow_is_agreed_where_its_gradient_lies(plan, groups):
    assert _moe(plan) == groups


@pytest.mark.parametrize(
    ("plan", "world", "groups"),
    [
        ({"zero": {"stage": 0}}, 2, []),
        ({"zero": {"stage": 2}}, 2, ["dp"]),
        ({"zero": {"stage": 3, "replicate": 2}}, 4, ["dp"]),
        (
            {"zero": {"stage": 1}, "parallel": {"tp": 2, "tp_layers": {
                "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}}},
            4,
            ["dp", "tp"],
        ),
    ],
    ids=["stage 0", "stage 2", "hybrid", "tp"],
)
def test_dense_plans_agree_over_the_groups_they_did(plan, world, groups):
    """What the pass named before (dp when the optimizer is sharded, tp, pp), in that order."""
    torch.manual_seed(0)
    assert _flag_groups(plan, world, tiny_gpt(), {"classes": ["Block"]}) == groups


def test_the_pass_names_no_dimension():
    """precision.py reads no degree of the mesh and imports no group name."""
    tree = ast.parse(Path(precision.__file__).read_text())
    degrees = {"tp", "pp", "ep", "replicate", "hybrid", "secondary", "data_parallel"}
    read = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in degrees]
    assert not read, read
    groups = [
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "zerocc.ir.ops"
        for a in n.names
        if a.name.endswith("_GROUP")
    ]
    assert not groups, groups
