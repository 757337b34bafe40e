"""What memory the machine has left: MemAvailable capped by the cgroup's limit."""

from __future__ import annotations

from pathlib import Path

from zerocc.runtime import machine_memory

GiB = 2**30


def _group(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")


def test_cgroup_v2_room_is_the_tightest_limit_along_the_path(tmp_path):
    root = tmp_path / "fs"
    _group(root, {"memory.max": "max"})
    stat = f"anon 1\ninactive_file {GiB}"
    _group(
        root / "job",
        {"memory.max": str(8 * GiB), "memory.current": str(3 * GiB), "memory.stat": stat},
    )
    _group(root / "job" / "step", {"memory.max": "max"})
    (tmp_path / "cgroup").write_text("0::/job/step\n")
    # 8 GiB limit, 3 GiB used of which 1 GiB reclaimable page cache
    assert machine_memory.cgroup_room(tmp_path / "cgroup", root) == 6 * GiB


def test_cgroup_v1_room_and_no_limit(tmp_path):
    root = tmp_path / "fs"
    files = {
        "memory.limit_in_bytes": str(4 * GiB),
        "memory.usage_in_bytes": str(GiB),
        "memory.stat": "total_inactive_file 0",
    }
    _group(root / "memory" / "job", files)
    (tmp_path / "cgroup").write_text("5:cpu:/job\n4:memory:/job\n")
    assert machine_memory.cgroup_room(tmp_path / "cgroup", root) == 3 * GiB
    _group(root / "memory" / "job", {"memory.limit_in_bytes": str(2**63 - 4096)})
    assert machine_memory.cgroup_room(tmp_path / "cgroup", root) is None


def test_host_memory_is_capped_by_the_cgroup(monkeypatch):
    assert machine_memory.host_available() > 0
    monkeypatch.setattr(machine_memory, "cgroup_room", lambda: 12345)
    assert machine_memory.host_available() == 12345
