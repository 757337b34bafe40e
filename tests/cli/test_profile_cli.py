"""`zerocc profile` on 2 local gloo ranks writes a calibration that `zerocc estimate` reads."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from zerocc.cli.main import main
from zerocc.cost.rates import DeviceRates

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "batch_size": 2}


def test_profile_writes_a_calibration_that_estimate_reads(tmp_path, capsys):
    for name in ("workload.py", "data.py", "model.py"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    plan = tmp_path / "tiny.yaml"
    fields = {"workload": "workload:workload", "workload_args": TINY, "zero": {"stage": 3},
              "backend": {"device": "cpu"}}  # fmt: skip
    plan.write_text(json.dumps({**fields, "units": {"classes": ["Block"]}}))
    run = subprocess.run(
        [sys.executable, "-m", "zerocc", "profile", str(plan), "--nproc", "2", "--steps", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    written = tmp_path / "tiny.calibration.json"  # the default: next to the plan
    assert f"wrote {written}" in run.stdout and "link" in run.stdout and "predicted" in run.stdout
    data = json.loads(written.read_text())
    measured = data["measured"]
    assert measured["world_size"] == 2 and measured["step_ms"]["measured"] > 0
    assert measured["step_ms"]["predicted"] > 0 and measured["ops"]["nodes"] > 50
    samples = measured["collectives"]["samples"]
    assert {s["kind"] for s in samples} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert {s["in_program"] for s in samples} == {True, False}  # the program's, and a sweep
    assert 0 <= data["rates"]["comm_overlap"] <= 1
    rates = DeviceRates.load(written)
    assert rates.device == "cpu" and rates.memory_bytes_per_s > 0
    assert rates.compute_flops and all(f > 0 for f in rates.compute_flops.values())
    # The overhead kept is the eager code's per op beyond the fitted work: none when the
    # fitted rates already explain the whole run (a noisy machine slows the op-by-op timings
    # the rates come from), never more than the profiler's own per-op cost.
    assert 0 <= rates.overhead_s * 1e6 <= measured["ops"]["profiled_overhead_us"]

    assert main(["estimate", str(plan), "--calibration", str(written), "--json"]) == 0
    timing = json.loads(capsys.readouterr().out)["timing"]
    assert set(timing["rate_sources"].values()) == {"calibration"}
    assert timing["rates"]["overhead_s"] == rates.overhead_s and timing["step_ms"] > 0
    # The same through the plan's cost section, with a link of the plan's own over it.
    plan.write_text(plan.read_text()[:-1] + ', "cost": {"calibration": "tiny.calibration.json",'
                    ' "link_gbps": 100}}')  # fmt: skip
    assert main(["estimate", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "link from the plan" in out and re.search(r"overlap[^;]* from the calibration", out)
