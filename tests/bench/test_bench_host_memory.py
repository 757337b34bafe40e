"""bench/host_memory.py end to end on a one-layer GPT, so the harness cannot rot: a plan runs in
a process of its own and its row holds the states zerocc measures, its host buffers, the
prediction (those states plus the memory check's step need) and the measured peak."""

from __future__ import annotations

import json

from bench_runs import run_bench


def test_host_memory_measures_a_plan_beside_its_prediction(tmp_path):
    run_bench("host_memory.py", "--layers", "1", "--plans", "opt-cpu", "--out", tmp_path,
              timeout=600)  # fmt: skip
    (result,) = tmp_path.glob("host-memory-cpu-*.json")
    (row,) = json.loads(result.read_text())["rows"]
    assert "error" not in row, row
    states = row["device_states"] + row["host_states"]
    assert row["host_states"] > 0 and row["host_buffers"] > 0
    assert row["predicted"] >= states + row["host_buffers"]
    assert row["measured"] > 0
