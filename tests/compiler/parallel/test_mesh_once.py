"""The ranks' mesh is computed once, from the plan and the world size, and passed on: one site
calls ``Mesh.of_plan`` (``zerocc.compiler.driver.session.plan_mesh``, what
``CompileSession.open`` calls), and only the entries that open no session call that (plan
check, the plan search's candidates); everything below them takes the session's mesh
(``PassContext.mesh``, ``StepRecord.mesh``, ``Inspection.mesh``)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.passes.spec import PassContext
from zerocc.compiler.plan import Plan

ROOT = Path(__file__).resolve().parents[3] / "zerocc"
THE_SITE = "compiler/driver/session.py"
# The entries that open no session, each building the mesh once for what it checks or sizes.
ENTRIES = {
    THE_SITE,  # CompileSession.open
    "cli/plan.py",  # plan check: a pipeline's micro-batches, sequence parallelism's loss
    "inspect/plan_search.py",  # how many batches a candidate's step trains on
}


def _calls(name: str) -> dict[str, int]:
    """The modules of zerocc/ calling ``name`` (as ``x.name(...)`` or ``name(...)``), with how
    many times."""
    found: dict[str, int] = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if called == name:
                module = path.relative_to(ROOT).as_posix()
                found[module] = found.get(module, 0) + 1
    return found


def test_mesh_of_plan_is_called_at_one_site():
    calls = _calls("of_plan")
    assert calls.get(THE_SITE) == 1, calls
    others = set(calls) - {THE_SITE}
    assert not others, (
        f"Mesh.of_plan called in {sorted(others)}: take the session's mesh (session.mesh, "
        "PassContext.mesh, StepRecord.mesh, Inspection.mesh), or at an entry that opens no "
        "session, zerocc.compiler.driver.session.plan_mesh once"
    )


def test_only_the_entries_build_a_mesh():
    calls = _calls("plan_mesh")
    below = set(calls) - ENTRIES
    assert not below, (
        f"plan_mesh called in {sorted(below)}, below the entries {sorted(ENTRIES)}: pass the "
        "entry's mesh down instead of building another"
    )


def test_a_pass_reads_the_session_mesh_not_a_rebuilt_one():
    """``PassContext.mesh`` is a field (the session's object), not a property that builds a
    new mesh from the plan at each read; a world size where the mesh goes is refused."""
    assert "mesh" in {f.name for f in dataclasses.fields(PassContext)}
    plan, mesh = Plan.model_validate({}), Mesh(4, replicate=2)
    ctx = PassContext(plan, mesh, ModelInfo((), (), ()))
    assert ctx.mesh is mesh and ctx.world_size == 4
    with pytest.raises(TypeError, match="PassContext.mesh: a Mesh"):
        PassContext(plan, 4, ModelInfo((), (), ()))  # type: ignore[arg-type]
