"""The Inductor backend (backends/inductor/): the program's compute regions compiled by
TorchInductor (C++ on this CPU), zerocc's ops left where the passes scheduled them; a region
Inductor cannot compile runs eagerly and explain() says so.

Tolerance against the eager backend, fp32: 1e-5 relative on each loss. Inductor fuses
elementwise ops and reorders reductions (a layer norm's mean and variance, a softmax's sum), so
results differ from eager by rounding, a few ulps per op, which grows over the layers and the
steps to ~1e-6 relative on the tiny GPT; 1e-5 leaves room without hiding a wrong kernel (a
missed update or a wrong gradient moves the loss by 1e-2 or more after the first step).
"""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt, tiny_gpt_dropout

import zerocc
from zerocc.backends.inductor.regions import REGION_PREFIX
from zerocc.ir.nodes import op_name

TOL = 1e-5


def _plan(backend: str, stage: int = 3, **sections) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "backend": {"name": backend, "device": "cpu"},
        **sections,
    }


def _run(backend: str, build=tiny_gpt, steps: int = 3, **plan) -> tuple[list[float], object]:
    torch.manual_seed(0)  # the same initial weights for every backend
    step = zerocc.compile(build(), _plan(backend, **plan))
    losses = [float(step(*_gpt_batch(i, 0))) for i in range(steps)]
    return losses, step


def _assert_close(ours: list[float], theirs: list[float]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {i}: {a} vs {b}"


@pytest.mark.parametrize("stage", [0, 3])
def test_inductor_trains_as_eager_does(stage):
    eager, _ = _run("eager", stage=stage)
    ours, step = _run("inductor", stage=stage)
    _assert_close(ours, eager)
    executable = step._last_program.run
    assert executable.reports and all(r.fallback is None for r in executable.reports)
    assert not any("run eagerly" in n for n in executable.notes())


def test_zerocc_ops_keep_their_scheduled_order_and_regions_hold_none():
    _, step = _run("inductor", steps=1)
    program, executable = step._last_program.gm, step._last_program.run
    scheduled = [op_name(n.target) for n in program.graph.nodes if _is_zerocc(n)]
    ran = [op_name(n.target) for n in executable.gm.graph.nodes if _is_zerocc(n)]
    assert ran == scheduled
    regions = [n for n in executable.gm.graph.nodes if n.op == "call_module"]
    assert regions and all(n.target.startswith(REGION_PREFIX) for n in regions)
    for node in regions:
        inner = getattr(executable.gm, node.target).region.graph.nodes
        assert not any(_is_zerocc(n) for n in inner)


def _is_zerocc(node) -> bool:
    return node.op == "call_function" and op_name(node.target).startswith("zerocc.")


def test_random_ops_draw_what_eager_draws():
    """Random ops run outside the regions, by ATen: dropout masks are eager's on every torch
    (torch 2.11's Inductor drew others under fallback_random)."""
    eager, _ = _run("eager", build=tiny_gpt_dropout)
    ours, step = _run("inductor", build=tiny_gpt_dropout)
    _assert_close(ours, eager)
    executable = step._last_program.run
    regions = [n for n in executable.gm.graph.nodes if n.op == "call_module"]
    inner = [n for r in regions for n in getattr(executable.gm, r.target).region.graph.nodes]
    assert not [n for n in inner if _is_random(n)]
    assert [n for n in executable.gm.graph.nodes if _is_random(n)]  # run in the top graph


def _is_random(node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in (
        target.tags
    )


def test_a_region_inductor_rejects_runs_eagerly_and_explain_says_so(monkeypatch):
    def rejects(module, example_inputs):
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", rejects)
    eager, _ = _run("eager")
    ours, step = _run("inductor")
    assert ours == eager  # every region eager: the eager backend's numbers, to the bit
    eager_lines = [n for n in step._last_program.run.notes() if "run eagerly" in n]
    assert len(eager_lines) == 1 and "RuntimeError: no C++ compiler found" in eager_lines[0]
    assert "second line" not in eager_lines[0] and eager_lines[0] in step.explain()


def test_a_second_launch_finds_every_region_in_inductors_caches():
    """Regions are compiled with a shape environment, so Inductor's caches (on disk) serve a
    region compiled before: a second step of the same plan, as a second launch would, compiles
    nothing (the first run may hit already: the cache outlives the process)."""
    from torch._dynamo.utils import counters

    _run("inductor", steps=1, overlap={"bucket_mb": 0})
    counters.clear()
    _, step = _run("inductor", steps=1, overlap={"bucket_mb": 0})
    regions = len(step._last_program.run.reports)
    cache = counters["aot_autograd"]
    assert cache["autograd_cache_hit"] == regions, dict(cache)
    assert not cache["autograd_cache_miss"] and not cache["autograd_cache_bypass"], dict(cache)


def test_the_dumps_hold_each_regions_generated_code():
    _, step = _run("inductor", steps=1)
    files = step.record().backend_artifacts
    table = files["regions.txt"].splitlines()
    regions = step._last_program.run.reports
    assert len(table) == 1 + len(regions) and all("compiled" in row for row in table[1:])
    for region in regions:
        assert "def call(" in files[f"{region.name}.py"]  # Inductor's entry point
