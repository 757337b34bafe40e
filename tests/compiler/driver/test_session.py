"""The compile session opens every plan, pipelines included (issue 78, item 2): the model is
converted to float8, described and split once, in the session, for every plan; a pipeline
rank's programs are compiled from the session narrowed to its stages. A pipeline plan was
refused by ``CompileSession.open`` (NotSupportedError), so the pipeline step and its inspection
each converted, described and split the model themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.plan import load_plan
from zerocc.compiler.workload import load_workload
from zerocc.errors import NotSupportedError
from zerocc.inspect import pipeline_estimate

ROOT = Path(__file__).resolve().parents[3] / "zerocc"
EXAMPLES = ROOT.parent / "examples" / "gpt"
# Plan check converts nothing and opens no session: it checks the splits before any rank starts.
CHECKS_BEFORE_LAUNCH = {"cli/plan.py"}


def _pipeline():
    plan = load_plan(EXAMPLES / "zero3-pp.yaml")
    return plan, load_workload(plan)


def test_a_pipeline_plan_opens_a_session():
    """The session of a pp 2 plan on 4 ranks: its mesh, the model described whole and split, and
    no units yet (each pipeline rank's come with the cut); its programs are compiled per
    pipeline rank, which ``program`` says."""
    plan, workload = _pipeline()
    session = CompileSession.open(workload.model, plan, 4, workload.loss_fn)
    assert session.pipeline and session.mesh.pp == 2 and session.mesh.world_size == 4
    names = {n for n, _ in workload.model.named_parameters()}
    assert {p.fqn for p in session.full_model_info.params} == names
    assert session.model_splits is not None and session.model_splits.local is session.model_info
    assert session.units == [] and len(session.layout) == 0
    with pytest.raises(NotSupportedError, match="compiled per pipeline rank"):
        session.program((), boundary=True, device=None)


def test_every_pipeline_rank_is_compiled_from_the_one_session(monkeypatch):
    """``zerocc estimate`` of a pipeline: each rank's session is the inspection's, narrowed to
    its stages (the same mesh, model description and splits, its own units)."""
    compiled, compile_rank = [], pipeline_estimate.compile_rank

    def kept(*args, **kwargs):
        compiled.append(compile_rank(*args, **kwargs))
        return compiled[-1]

    monkeypatch.setattr(pipeline_estimate, "compile_rank", kept)
    plan, workload = _pipeline()
    opened = pipeline_estimate.estimate_pipeline(plan, 4, workload).inspection.session
    assert len(compiled) == 2
    for rank in (c.session for c in compiled):
        assert rank.mesh is opened.mesh and rank.full_model_info is opened.full_model_info
        assert rank.model_splits is opened.model_splits and rank.units
    held = [{p.fqn for p in c.session.model_info.params} for c in compiled]
    assert held[0] != held[1] and held[0] | held[1] == {p.fqn for p in opened.model_info.params}


def _calls(name: str, owner: str) -> set[str]:
    """The modules of zerocc/ calling ``owner.name(...)``."""
    found = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and f.attr == name:
                if isinstance(f.value, ast.Name) and f.value.id == owner:
                    found.add(path.relative_to(ROOT).as_posix())
    return found


@pytest.mark.parametrize("call", [("convert", "Float8Layers"), ("of", "ModelSplits")])
def test_the_model_is_converted_and_split_in_the_session_alone(call):
    """Float8 conversion and the model's splits are the session's, for every plan."""
    found = _calls(*call) - CHECKS_BEFORE_LAUNCH
    assert found == {"compiler/driver/session.py"}, found
