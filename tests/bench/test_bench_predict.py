"""bench/predict.py end to end on a tiny GPT, so the harness cannot rot: each backend's case
is calibrated on its ranks, measured and predicted, and the calibration times every op of the
program whatever the backend compiled."""

from __future__ import annotations

import json

from bench_runs import run_bench

TINY = ["--layers", "1", "--embd", "32", "--steps", "2"]


def test_predict_calibrates_and_predicts_each_backend(tmp_path):
    # Exit code 1 is a missed 25% target: a 10 ms step on a shared machine may miss it.
    run_bench("predict.py", "--stages", "3", "--backends", "eager", "inductor-regions", *TINY,
              "--out", tmp_path, exit_code=(0, 1))  # fmt: skip
    (result,) = tmp_path.glob("predict-cpu-*.json")
    cases = {c["case"]: c for c in json.loads(result.read_text())["cases"]}
    assert list(cases) == ["zero-3", "zero-3 inductor-regions"]
    for case in cases.values():
        assert case["measured_ms"] > 0 and case["predicted_ms"] > 0
        assert case["predicted_with_other_ms"] > 0  # the other backend's rates
        assert "FLOP/s" in case["calibration"]["ops"]["fitted"]
    eager, regions = (c["calibration"]["ops"]["nodes"] for c in cases.values())
    assert regions == eager  # every op timed, not Inductor's regions as one call each
