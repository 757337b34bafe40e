"""bench/pipeline.py end to end on a one-layer GPT, so the harness cannot rot: each
offload.pipeline trains with the host's worker on a thread, next_forward's losses equal none's,
delayed's differ (its gradients are a step stale), and the table and JSON say so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PIPELINE = Path(__file__).parent.parent / "bench" / "pipeline.py"


def test_pipeline_tiny_runs_and_holds_next_forward_to_the_plain_losses(tmp_path):
    run = subprocess.run(
        [sys.executable, str(PIPELINE), "--layers", "1", "--embd", "64", "--rounds", "2",
         "--steps", "2", "--kernels", "fused", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = tmp_path.glob("pipeline-cpu-*.json")
    rows = {r["mode"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {"none", "next_forward", "delayed"}
    assert rows["next_forward"]["losses_identical"] and not rows["delayed"]["losses_identical"]
    assert all(r["median_step_s"] > 0 and len(r["losses"]) == 2 + 2 * 2 for r in rows.values())
    assert rows["none"]["x_none"] == 1.0
    assert run.stdout.rstrip().splitlines()[-1].startswith("fused    delayed")
