"""The optimizer pass (zerocc/compiler/passes/optimizer.py) asks the mesh over which groups a
unit's gradient lies (``Mesh.gradient_groups``) and sums its checks there, instead of
branching on each dimension: a group the mesh names is summed over, and the pass names none
of the dimensions itself."""

from __future__ import annotations

import ast
from pathlib import Path

import zerocc
from zerocc.compiler.parallel.dims import Spread
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.passes import optimizer
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name
from zerocc.ir.ops import SECONDARY_GROUP


def _reductions(gm) -> list[tuple[str, str]]:
    """The optimizer's all-reduces: (group, note)."""
    return [
        (n.args[1], info(n).note or "")
        for n in gm.graph.nodes
        if op_name(n.target) == "zerocc.all_reduce_start" and info(n).phase == "optimizer"
    ]


def _stepping(**plan) -> object:
    plan = {"workload": "workload:workload", "units": {"classes": ["Block"]}, **plan}
    return inspect_plan(zerocc.load_plan(plan), 4).stepping.gm


def test_the_checks_are_summed_over_the_groups_the_mesh_names(monkeypatch):
    """A group the mesh says a unit's gradient lies over is where the non-finite flags and
    the clip's squared norm are summed: here a stand-in dimension spreading every unit over
    the secondary groups (as a new dimension's module would)."""
    plan = {"zero": {"stage": 2}, "optimizer": {"name": "adamw", "grad_clip": 1.0}}
    assert [g for g, _ in _reductions(_stepping(**plan))] == ["dp"]  # (flags and norm: one)
    said = Mesh.gradient_groups
    extra = Spread(SECONDARY_GROUP, "parts", "a stand-in dimension's ranks")
    monkeypatch.setattr(
        Mesh, "gradient_groups", lambda self, group, sharded: (*said(self, group, sharded), extra)
    )
    reductions = _reductions(_stepping(**plan))
    assert [g for g, _ in reductions] == ["dp", SECONDARY_GROUP]
    assert "over a stand-in dimension's ranks" in reductions[1][1]


def test_the_pass_names_no_dimension():
    """optimizer.py reads no degree of the mesh (tp, pp, ep, replicate, hybrid) and imports no
    group name but ``dp`` (a unit's default shard group, what an all-reduce defaults to)."""
    tree = ast.parse(Path(optimizer.__file__).read_text())
    degrees = {"tp", "pp", "ep", "replicate", "hybrid", "secondary"}
    read = [
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr in degrees
        and isinstance(n.value, ast.Attribute) and n.value.attr == "mesh"
    ]  # fmt: skip
    assert not read, read
    groups = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "zerocc.ir.ops"
        for a in n.names
        if a.name.endswith("_GROUP")
    }
    assert groups == {"DP_GROUP"}, groups
