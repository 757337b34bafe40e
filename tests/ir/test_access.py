"""The storage analysis (zerocc/ir/access.py): which storage root each node's value belongs
to, and what each node reads and writes, the facts the overlap pass may not reorder across."""

from __future__ import annotations

import operator

import torch
from torch import fx

import zerocc
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.access import Access, StorageRoots
from zerocc.ir.kinds import OpKind
from zerocc.ir.nodes import PARAM_FULL, PARAM_SHARD, info, op_kind, op_name

aten = torch.ops.aten


def _graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    view = graph.call_function(aten.view.default, (x, [4]))
    add = graph.call_function(aten.add.Tensor, (view, y))
    add_ = graph.call_function(aten.add_.Tensor, (y, add))
    parts = graph.call_function(aten.split.Tensor, (add, 2))
    first = graph.call_function(operator.getitem, (parts, 0))
    graph.output((add_, first))
    nodes = {"x": x, "y": y, "view": view, "add": add, "add_": add_, "getitem": first}
    return fx.GraphModule(torch.nn.Module(), graph), nodes


def test_views_and_in_place_results_share_their_arguments_root():
    gm, n = _graph()
    roots = StorageRoots(gm)
    assert roots.root[n["view"]] is n["x"]
    assert roots.root[n["add"]] is n["add"]  # a new allocation is its own root
    assert roots.root[n["add_"]] is n["y"]  # in place: y's storage
    assert roots.root[n["getitem"]] is n["add"]  # a piece of split's views of add


def test_reads_and_writes():
    gm, n = _graph()
    roots = StorageRoots(gm)
    assert roots.access(n["add"]) == Access(frozenset({n["x"], n["y"]}), frozenset({n["add"]}))
    add_ = roots.access(n["add_"])
    assert n["y"] in add_.writes and n["add"] in add_.reads
    assert roots.access(n["add_"]).conflicts(roots.access(n["add"]))  # add reads y, add_ writes it
    assert not roots.access(n["view"]).conflicts(roots.access(n["add"]))  # both only read x


def _program(stage: int) -> fx.GraphModule:
    plan = {
        "workload": "workload:workload",
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
    }
    return inspect_plan(zerocc.load_plan(plan), 2).stepping.gm


def test_a_stage_2_shard_is_rooted_in_its_full_flat_parameter():
    gm = _program(2)
    roots = StorageRoots(gm)
    full = {info(n).unit: n for n in gm.graph.nodes if info(n).role == PARAM_FULL}
    shards = [n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == PARAM_SHARD]
    assert shards and all(roots.root[s] is full[info(s).unit] for s in shards)


def test_a_wait_aliases_its_start_and_a_collective_writes_its_output_while_in_flight():
    gm = _program(3)
    roots = StorageRoots(gm)
    waits = [n for n in gm.graph.nodes if op_kind(n) is OpKind.WAIT]
    assert waits
    for wait in waits:
        start = wait.args[0]
        assert roots.root[wait] is roots.root[start]
        in_flight = roots.collective_access(start, wait)
        assert roots.root[start] in in_flight.writes
        assert roots.access(start).reads <= in_flight.reads
    gathers = [w for w in waits if op_name(w.args[0].target) == "zerocc.all_gather_start"]
    assert gathers and all(roots.root[w] is w.args[0] for w in gathers)  # a fresh buffer
