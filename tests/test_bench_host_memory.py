"""bench/host_memory.py end to end on a one-layer GPT, so the harness cannot rot: a plan runs in
a process of its own and its row holds the states zerocc measures, its host buffers, the
prediction (those states plus the memory check's step need) and the measured peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HOST_MEMORY = Path(__file__).parent.parent / "bench" / "host_memory.py"


def test_host_memory_measures_a_plan_beside_its_prediction(tmp_path):
    command = [sys.executable, str(HOST_MEMORY), "--layers", "1", "--plans", "opt-cpu",
               "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = tmp_path.glob("host-memory-cpu-*.json")
    (row,) = json.loads(result.read_text())["rows"]
    assert "error" not in row, row
    states = row["device_states"] + row["host_states"]
    assert row["host_states"] > 0 and row["host_buffers"] > 0
    assert row["predicted"] >= states + row["host_buffers"]
    assert row["measured"] > 0
