"""What memory this machine has left for a rank, per pool, read from the operating system and
the GPU.

Two pools: ``host`` (RAM) and, on a GPU, ``device`` (the GPU's memory). Host memory is the
kernel's ``MemAvailable`` (free memory plus the caches it can reclaim), capped by the room left
under this process's cgroup memory limit where there is one: in a container or a batch job
that limit, not the machine's RAM, is what the OOM killer enforces. Device memory is what
``torch.cuda.mem_get_info`` reports free plus what PyTorch's caching allocator holds unused.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

HOST_POOL = "host"
DEVICE_POOL = "device"

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def pool_names(device: torch.device) -> dict[str, str]:
    """The pools a run on ``device`` draws on, with how messages name them."""
    if device.type == "cuda":
        return {DEVICE_POOL: f"memory of {device}", HOST_POOL: "host memory"}
    return {HOST_POOL: "host memory (this machine has no GPU)"}


def available_memory(device: torch.device) -> dict[str, int]:
    """Bytes this process could still allocate now in each pool of a run on ``device``."""
    out = {HOST_POOL: host_available()}
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        out[DEVICE_POOL] = free + cached
    return out


def host_available() -> int:
    """Host memory available now: ``MemAvailable`` (other systems: free physical pages), capped
    by the room under this process's cgroup memory limit."""
    available = _meminfo_available()
    room = cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_room(cgroups: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroup and its parents
    (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), less what the group uses that the
    kernel cannot reclaim (usage minus inactive file pages, as ``docker stats`` counts it); None
    where no limit is set or cgroups cannot be read. ``cgroups``: the process's cgroup list;
    ``root``: where the hierarchies are mounted."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # v2, unified
            files = root, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):  # v1
            files = (
                root / "memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        else:
            continue
        rooms += _rooms_along(*files, path)
    return min(rooms, default=None)


def _rooms_along(root: Path, limit: str, usage: str, inactive: str, path: str) -> list[int]:
    """Room under each limited cgroup from ``path`` up to the root of the hierarchy (inside a
    cgroup namespace ``path`` is ``/`` and the mount is the container's own group)."""
    rooms = []
    group = root / path.lstrip("/")
    while True:
        room = _room_in(group, limit, usage, inactive)
        if room is not None:
            rooms.append(room)
        if group == root or root not in group.parents:
            return rooms
        group = group.parent


def _room_in(group: Path, limit: str, usage: str, inactive: str) -> int | None:
    try:
        text = (group / limit).read_text().strip()
        if text == "max" or int(text) >= _UNLIMITED:
            return None
        used = int((group / usage).read_text())
        stat = (group / "memory.stat").read_text().split()
        reclaimable = dict(zip(stat[::2], stat[1::2], strict=False)).get(inactive, "0")
        return max(int(text) - (used - int(reclaimable)), 0)
    except (OSError, ValueError):
        return None
