"""bench/offload.py end to end on a tiny GPT, zerocc only, so the harness cannot rot: the baseline
and NVMe optimizer offload run on two gloo ranks, their losses are identical step by step, and
the offloaded optimizer states are counted in their own pool, off the device; a delayed update,
whose losses differ by design, is reported without failing the run."""

from __future__ import annotations

import json

from bench_runs import run_bench


def test_offload_tiny_runs_and_keeps_the_losses(tmp_path):
    systems = ["zerocc-z3-opt-nvme", "zerocc-z3-opt-cpu-delayed"]
    run = run_bench("offload.py", "--tiny", "--systems", *systems, "--nvme-dir", tmp_path,
                    "--out", tmp_path)  # fmt: skip
    (result,) = tmp_path.glob("offload-cpu-*.json")
    report = json.loads(result.read_text())
    systems = {s["name"]: s for s in report["systems"]}
    # The baseline comes along.
    assert set(systems) == {"zerocc-z3", "zerocc-z3-opt-nvme", "zerocc-z3-opt-cpu-delayed"}
    base, nvme = systems["zerocc-z3"], systems["zerocc-z3-opt-nvme"]
    for s in (base, nvme):
        assert s["status"] == "ok", s.get("error")
        assert s["losses_identical"] is True and s["median_step_s"] > 0
        assert s["predicted_step_s"] > 0 and s["predicted_rates"] == "default"
    delayed = systems["zerocc-z3-opt-cpu-delayed"]
    assert delayed["status"] == "ok" and delayed["losses_identical"] is None
    assert base["x_own_baseline"] == 1.0 and base["state_bytes"]["nvme"] == 0
    # fp32 AdamW: a master and two moments per offloaded shard, in files (data plus a header
    # each), read and written once a step; the moments left the device, the master is new.
    moved = nvme["copy_bytes"]["nvme_read"]
    assert nvme["copy_bytes"]["nvme_write"] == moved > 0
    assert nvme["copy_bytes"] == nvme["copy_bytes_as_compiled"]
    assert nvme["state_bytes"]["host"] == 0 and 0 < nvme["state_bytes"]["nvme"] - moved < 2**16
    assert base["state_bytes"]["device"] - nvme["state_bytes"]["device"] == 2 * moved // 3
    assert not list(tmp_path.glob("zerocc-bench-nvme-*")), "the NVMe folder was not removed"
    header, _, *rows = run.stdout.rstrip().splitlines()[-5:]  # the table comes last
    assert header.startswith("system") and [r.split()[0] for r in rows] == list(systems)


def test_offload_sequential_times_each_system_before_setting_up_the_next(tmp_path):
    """--sequential (a GPU session's memory and time limits): each system's rounds run, and it
    closes, before the next is set up; its step times are printed as they end."""
    run = run_bench("offload.py", "--tiny", "--sequential", "--systems", "zerocc-z3-opt-cpu",
                    "--out", tmp_path)  # fmt: skip
    (result,) = tmp_path.glob("offload-cpu-*.json")
    report = json.loads(result.read_text())
    assert report["config"]["sequential"] is True
    assert all(s["status"] == "ok" and s["losses_identical"] for s in report["systems"])
    progress = [line for line in run.stdout.splitlines() if line.startswith(("setting", "round"))]
    assert progress == [
        "setting up zerocc-z3 ...",
        "round 1/1: zerocc-z3",
        "setting up zerocc-z3-opt-cpu ...",
        "round 1/1: zerocc-z3-opt-cpu",
    ]
    assert "  zerocc-z3-opt-cpu: steps " in run.stdout and "(the first untimed)" in run.stdout
