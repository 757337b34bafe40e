"""bench/snapshot_write.py end to end on a few MiB, so the harness cannot rot: every way of
writing a snapshot has its rows, and each timing is a positive number."""

from __future__ import annotations

import json

from bench_runs import run_bench


def test_snapshot_write_times_each_way_of_writing(tmp_path):
    run_bench("snapshot_write.py", "--gib", "0.004", "--repeat", "2", "--out", tmp_path)
    (result,) = tmp_path.glob("snapshot-write-*.json")
    median = json.loads(result.read_text())["median"]
    assert median.keys() == {"snapshot, new file", "snapshot, reused", "torch.save",
                             "snapshot read"}  # fmt: skip
    assert all(wall > 0 for wall, _ in median.values())
