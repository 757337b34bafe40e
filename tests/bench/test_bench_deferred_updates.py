"""bench/deferred_updates.py end to end on a one-layer GPT, so the harness cannot rot: each
offload.defer_updates trains with the host's worker on a thread, next_forward's losses equal none's,
delayed's differ (its gradients are a step stale), and the table and JSON say so."""

from __future__ import annotations

import json

from bench_runs import run_bench


def test_deferred_updates_tiny_runs_and_holds_next_forward_to_the_plain_losses(tmp_path):
    run = run_bench("deferred_updates.py", "--layers", "1", "--embd", "64", "--rounds", "2",
                    "--steps", "2", "--kernels", "fused", "--out", tmp_path)  # fmt: skip
    (result,) = tmp_path.glob("deferred_updates-cpu-*.json")
    rows = {r["mode"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {"none", "next_forward", "delayed"}
    assert rows["next_forward"]["losses_identical"] and not rows["delayed"]["losses_identical"]
    assert all(r["median_step_s"] > 0 and len(r["losses"]) == 2 + 2 * 2 for r in rows.values())
    assert rows["none"]["x_none"] == 1.0
    assert run.stdout.rstrip().splitlines()[-1].startswith("fused    delayed")
