"""`zerocc estimate` against memory measured in real runs, and on a model far larger than the
machine; `zerocc train --dump` writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multirank import run_ranks

import zerocc
from zerocc.compiler.units import Unit
from zerocc.inspect.estimate import estimate, inspect_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"
SMALL = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4}


def _plan(stage: int, **extra) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": {"grad_clip": 1.0},
        "workload": "workload:workload",
        "workload_args": SMALL,
        "backend": {"device": "cpu"},
        **extra,
    }


def _measure(rank: int, world: int) -> list[dict]:
    from workload import workload

    out = []
    for stage in range(4):
        work = workload(**SMALL)
        step = zerocc.compile(work.model, _plan(stage))
        batches = work.batches(rank, world)
        step(*next(batches))  # compiles; the next step is the one measured
        _, recorder = step.profile(*next(batches))
        predicted = estimate(inspect_plan(_plan(stage), world, work)) if rank == 0 else None
        out.append(
            {
                "model_states": step.model_state_bytes()["total"],
                "peak": recorder.timeline.peak()[1],
                "predicted": predicted.as_dict() if predicted else None,
            }
        )
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_ranks(2, _measure)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_a_measured_two_rank_run(measured, stage):
    """Model states within 5% and peak within 15% (the issue's bounds; on this CPU they agree to
    the byte: the same program, the liveness the eager code follows)."""
    run = measured[stage]
    predicted = run["predicted"]
    assert predicted["model_states"]["total"] == pytest.approx(run["model_states"], rel=0.05)
    assert predicted["peak"]["total"] == pytest.approx(run["peak"], rel=0.15)


def test_a_7b_model_on_the_meta_device_estimates_without_memory():
    inspection = inspect_plan(EXAMPLES / "7b.yaml", 64)
    figures = estimate(inspection)
    units: list[Unit] = inspection.units
    psi = sum(u.padded_numel for u in units)
    assert 6.5e9 < sum(u.numel for u in units) < 7e9
    # bf16 params, fp32 master + Adam moments, each over 64 ranks. No gradient is state at
    # grad_accumulation 1: the updates read the reduced fp32 shards, held within the step.
    assert figures.model_states["params"] == psi * 2 // 64
    assert figures.model_states["grads"] == 0 and figures.held_grads == psi * 4 // 64
    assert figures.model_states["optimizer"] == psi * 12 // 64 + 16  # + step counter, lr
    # Stage 3: gathered twice in bf16, reduce-scattered once in fp32.
    assert figures.comm["all_gather"] == 2 * 2 * psi and figures.comm["reduce_scatter"] == 4 * psi
    block = next(u for u in units if u.name == "transformer.h.0")
    assert figures.peak["gathered"] >= 2 * block.padded_numel  # a bf16 block at least


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_gives_zeros_bytes_per_parameter_with_bf16_gradients(stage):
    """precision.grad: bf16 (reduce: bf16), gradients accumulated over micro-batches: model
    states of exactly 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (ZeRO's mixed-precision Adam; + 16
    bytes of AdamW's step counter and the learning rate). At grad_accumulation 1 the gradients
    are no state: the update reads the bf16 reduced shards, held within the step (2 bytes,
    sharded from stage 1 on, which then reduces as stage 2 does)."""
    from workload import workload

    n = 4
    bf16 = {"param": "bf16", "reduce": "bf16", "grad": "bf16"}
    work = workload(**SMALL)
    kept = estimate(inspect_plan(_plan(stage, precision=bf16, grad_accumulation=2), n, work))
    psi = sum(u.padded_numel for u in inspect_plan(_plan(stage), n, work).units)
    zero = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    assert kept.model_states["total"] == zero[stage] + 16
    assert kept.model_states["grads"] == 2 * psi // (n if stage >= 2 else 1)
    held = estimate(inspect_plan(_plan(stage, precision=bf16), n, work))
    assert held.model_states["total"] == zero[stage] + 16 - kept.model_states["grads"]
    assert held.held_grads == 2 * psi // (n if stage >= 1 else 1)


def test_train_dump_writes_programs_trace_memory_and_report(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps(_plan(3, precision={"param": "bf16"})))
    (tmp_path / "workload.py").write_text((EXAMPLES / "workload.py").read_text())
    (tmp_path / "data.py").write_text((EXAMPLES / "data.py").read_text())
    (tmp_path / "model.py").write_text((EXAMPLES / "model.py").read_text())
    dump = tmp_path / "dump"
    run = subprocess.run(
        [sys.executable, "-m", "zerocc", "train", str(plan), "--nproc", "2", "--steps", "2",
         "--dump", str(dump)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    programs = sorted(p.name for p in (dump / "programs" / "step-0").iterdir())
    for i, name in enumerate(["capture", "partition", "shard", "precision", "optimizer"]):
        assert f"{i:02d}-{name}.py" in programs and f"{i:02d}-{name}.dot" in programs
    trace = json.loads((dump / "trace.json").read_text())["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X"]
    for rank in (0, 1):
        tracks = {e["tid"] for e in slices if e["pid"] == rank}
        assert tracks == {0, 1}, rank  # compute and comm
    gathers = [e for e in slices if e["name"].startswith("all_gather ")]
    assert gathers and all(e["args"]["bytes"] > 0 and e["dur"] >= 0 for e in gathers)
    png = (dump / "memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    report = (dump / "report.html").read_text()
    for heading in ("Plan", "Passes", "Units", "Memory", "Estimate", "Timeline", "Programs"):
        assert f">{heading}</h2>" in report
    assert "data:image/png;base64," in report and "ui.perfetto.dev" in report


def test_dump_of_the_accumulating_program_too(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROCC_DUMP_DIR", str(tmp_path))
    from models import tiny_gpt
    from parity import batch_of

    step = zerocc.compile(tiny_gpt(), {"grad_accumulation": 2, "units": {"classes": ["Block"]}})
    for i in range(2):
        step(*batch_of({"model": "gpt"}, i, 0))
    assert {p.name for p in (tmp_path / "programs").iterdir()} == {"accumulate-0", "step-1"}
    assert (tmp_path / "report.html").exists()
    assert torch.isfinite(step(*batch_of({"model": "gpt"}, 2, 0)))  # and training goes on
