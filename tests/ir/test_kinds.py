"""The IR's vocabularies (zerocc/ir/kinds.py) and the one classification of ops (op_kind)."""

from __future__ import annotations

import pytest

import zerocc
from zerocc.cost.model import node_work
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.kinds import OpKind, Role, Stream
from zerocc.ir.nodes import info, op_kind, op_name
from zerocc.ir.ops import COLLECTIVE_STARTS, TRANSFER_STARTS

PLANS = {
    "stage 3, buckets": {"zero": {"stage": 3}, "overlap": {"bucket_mb": 1}},
    "offload, recompute, bf16": {
        "zero": {"stage": 3},
        "precision": {"param": "bf16"},
        "recompute": {"units": "all"},
        "offload": {"optimizer": "cpu", "params": "cpu"},
    },
    "stage 0": {"zero": {"stage": 0}},
}


@pytest.fixture(scope="module", params=list(PLANS))
def program(request):
    plan = {"workload": "workload:workload", "units": {"classes": ["Block"]}}
    return inspect_plan(zerocc.load_plan({**plan, **PLANS[request.param]}), 2).stepping.gm


def test_every_zerocc_op_of_a_program_has_its_kind(program):
    expected = {
        **dict.fromkeys(COLLECTIVE_STARTS, OpKind.COLLECTIVE),
        **dict.fromkeys(TRANSFER_STARTS, OpKind.TRANSFER),
        "wait": OpKind.WAIT,
        "free": OpKind.FREE,
        "rng_state": OpKind.RNG,
        "set_rng_state": OpKind.RNG,
    }
    for node in program.graph.nodes:
        name = op_name(node.target) if node.op == "call_function" else ""
        if name.startswith("zerocc."):
            assert op_kind(node) is expected.get(name.removeprefix("zerocc."), OpKind.COMPUTE)
        elif node.op != "call_function":
            assert op_kind(node) is OpKind.PLUMBING


def test_each_start_is_waited_on_and_runs_off_the_compute_stream(program):
    kinds = [op_kind(n) for n in program.graph.nodes]
    starts = kinds.count(OpKind.COLLECTIVE) + kinds.count(OpKind.TRANSFER)
    assert starts == kinds.count(OpKind.WAIT) > 0
    for node in program.graph.nodes:
        if op_kind(node) is OpKind.COLLECTIVE:
            assert info(node).stream is Stream.COMM
        if op_kind(node) is OpKind.TRANSFER:
            assert info(node).stream is Stream.COPY


def test_the_cost_model_reads_the_same_kinds(program):
    for node in program.graph.nodes:
        kind, work = op_kind(node), node_work(node).kind
        if kind in (OpKind.COLLECTIVE, OpKind.TRANSFER, OpKind.WAIT, OpKind.PLUMBING):
            assert work is kind
        else:  # views, releases and generator states cost the per-op overhead, as compute
            assert work is OpKind.COMPUTE


def test_views_write_nothing_and_in_place_ops_are_compute(program):
    for node in program.graph.nodes:
        if op_kind(node) is OpKind.VIEW:
            assert not any(
                a.alias_info and a.alias_info.is_write for a in node.target._schema.arguments
            )
    in_place = [n for n in program.graph.nodes if op_name(n.target).endswith("_")]
    assert all(
        op_kind(n) is OpKind.COMPUTE for n in in_place if op_name(n.target).startswith("aten.")
    )


def test_members_are_their_strings():
    """Records and printed programs read as before: a member equals its value."""
    assert Role.PARAM_FULL == "param_full" and f"{Stream.COMM}" == "comm"
    assert {r.value for r in Role} >= {"param_shard", "grad_shard", "gathered", "found_inf"}
