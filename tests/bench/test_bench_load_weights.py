"""bench/load_weights.py end to end on a two-layer Llama, so the harness cannot rot: each system
loads the saved folder in a process of its own, and its row holds the rank's states, its peak
and its times."""

from __future__ import annotations

import json

import pytest
from bench_runs import run_bench

pytest.importorskip("transformers", reason='the benchmark loads Hugging Face folders: "zerocc[hf]"')


def test_load_weights_measures_both_systems(tmp_path):
    run_bench("load_weights.py", "--layers", "2", "--hidden", "64", "--vocab", "256",
              "--world-sizes", "2", "--rounds", "1", "--out", tmp_path, timeout=600)  # fmt: skip
    (result,) = tmp_path.glob("load-weights-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(r["system"], r["world"]) for r in rows] == [("transformers", 2), ("zerocc", 2)]
    assert rows[0]["states"] == rows[1]["states"] > 0  # the same shards either way
    assert all(r["peak"] > 0 and r["wall_s"] > 0 for r in rows)
