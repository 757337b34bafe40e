"""The parallel dimensions (zerocc/compiler/parallel/dims/): each one registers its degree, its
plan field, its groups and each rank's place in them; the mesh composes them and names none
itself, so that the next dimension is a module and a line in ``DIMENSIONS``."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from zerocc.compiler.parallel import dims
from zerocc.compiler.parallel.dims import DIMENSIONS, MeshLayout, Spread
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan import Plan
from zerocc.errors import PlanError
from zerocc.ir import ops

PARALLEL = Path(dims.__file__).resolve().parent.parent


def test_every_degree_and_group_is_one_dimension_s():
    """Each degree of the layout is one dimension's, read from the plan field it names; each
    group kind the program's collectives name is made by exactly one dimension."""
    degrees = [f.name for f in dataclasses.fields(MeshLayout)][1:]
    assert sorted(d.degree for d in DIMENSIONS) == sorted(degrees)
    made = [g.name for d in DIMENSIONS for g in d.groups]
    named = {v for k, v in vars(ops).items() if k.endswith("_GROUP") and isinstance(v, str)}
    assert len(made) == len(set(made)) and set(made) == named


def test_each_dimension_reads_its_own_plan_field():
    plan = Plan.model_validate(
        {
            "zero": {"stage": 3, "replicate": 2},
            "parallel": {"tp": 2, "tp_layers": {"*.mlp.c_fc": "colwise"}, "ep": 2},
        }
    )
    mesh = Mesh.of_plan(plan, 16)
    for d in DIMENSIONS:
        section, name = d.field.split(".")
        assert d.read(plan) == getattr(getattr(plan, section), name) == getattr(mesh, d.degree)
    assert (mesh.replicate, mesh.tp, mesh.ep) == (2, 2, 2)


def test_the_mesh_names_no_dimension_itself():
    """mesh.py composes the registered dimensions: it imports no group name and reads no
    degree (they are the dimensions' modules' and MeshLayout's)."""
    tree = ast.parse((PARALLEL / "mesh.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "zerocc.ir.ops" not in imported
    degrees = {d.degree for d in DIMENSIONS} | {"hybrid"}
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & degrees
    assert read == {"pp"}, read  # (the stage blocks every stage-local group repeats over)


def _meshes() -> list[Mesh]:
    """The layouts of 4, 8 and 16 ranks with each degree 1 or 2 that the ranks can take."""
    meshes = []
    for layout in itertools.product([4, 8, 16], [1, 2], [1, 2], [1, 2], [1, 2], [1, 2]):
        try:
            meshes.append(Mesh.of(*layout))
        except PlanError:
            pass
    return meshes


@pytest.mark.parametrize("mesh", _meshes(), ids=str)
def test_every_group_partitions_the_ranks_and_places_them_in_order(mesh):
    """For each dimension's group kinds a layout makes: the groups of a kind hold every rank
    once (the tie groups: a pipeline's two ends), and a rank's place in its group is its
    index there: what a shard's or a slice's owner is found by."""
    for group in (g for d in DIMENSIONS for g in d.groups if g.made(mesh)):
        groups = mesh.groups(group.name)
        ranks = sorted(r for g in groups for r in g)
        if group.name != ops.TIE_GROUP:
            assert ranks == list(range(mesh.world_size)), group.name
        if group.place is not None:
            for g in groups:
                assert [mesh.group_rank(group.name, r) for r in g] == list(range(len(g)))


def test_a_unit_s_gradient_groups_come_from_the_dimensions():
    """Where a unit's gradient lies in parts: its shard group's slices (stages 1-3), the tp
    ranks' slices, the pipeline's other stages; an experts unit's beyond them under hybrid
    sharding (the other replicas) or at stage 0 (the other ep ranks' experts)."""

    def groups(mesh: Mesh, group: str, sharded: bool) -> list[tuple[str, str]]:
        return [(s.group, s.holds) for s in mesh.gradient_groups(group, sharded)]

    assert groups(Mesh(4), "dp", True) == [("dp", "parts")]
    assert groups(Mesh(4), "dp", False) == []
    assert groups(Mesh(1), "dp", True) == []
    tp_pp = Mesh(16, tp=2, pp=2)
    assert groups(tp_pp, "dp", True) == [("dp", "parts"), ("tp", "parts"), ("pp", "units")]
    experts = Mesh(8, replicate=2, ep=2)
    assert groups(experts, "dp", True) == [("dp", "parts")]
    assert groups(experts, "edp", True) == [("dp", "parts"), ("replicate", "parts")]
    assert groups(Mesh(4, ep=2), "edp", True) == [("dp", "parts")]
    assert groups(Mesh(4, ep=2), "edp", False) == [("ep", "parts")]
    assert all(isinstance(s, Spread) for s in tp_pp.gradient_groups("dp", True))


def test_an_unknown_group_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown group 'cp'; known: dp, replicate, tp, pp"):
        Mesh(4).groups("cp")
    with pytest.raises(ValueError, match="the pp groups' ranks hold nothing apart"):
        Mesh(4, pp=2).group_rank("pp", 0)
