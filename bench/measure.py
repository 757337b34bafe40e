"""What bench/compare.py measures in each rank process, the same way for every system.

- Resident memory from ``/proc/self/status``: ``VmRSS`` now, ``VmHWM`` the peak since the
  process started or since :func:`reset_peak_rss` (``/proc/self/clear_refs``).
- Bytes communicated, counted at ``torch.distributed``: :class:`CommCounter` wraps its
  collectives before any system imports them, so FSDP2, DeepSpeed and zerocc are counted by one
  rule, the ZeRO paper's: an all-gather counts its output, a reduce-scatter its input, an
  all-reduce twice its size, a reduce or broadcast its size.
- The bytes the ZeRO formula predicts per optimizer step and rank, to check the counts against.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

# name in torch.distributed -> (kind, bytes it moves from its (args, kwargs))
_COLLECTIVES: dict[str, tuple[str, Callable[..., int]]] = {}


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _collective(names: tuple[str, ...], kind: str, arg: int, times: int = 1) -> None:
    """Count ``times`` × the bytes of positional argument ``arg`` (a tensor or list of them)."""

    def count(*args: Any) -> int:
        value = args[arg]
        return times * _nbytes(value if isinstance(value, list | tuple) else [value])

    for name in names:
        _COLLECTIVES[name] = (kind, count)


_collective(("all_gather_single", "all_gather_into_tensor", "_all_gather_base"), "all_gather", 0)
_collective(("all_gather",), "all_gather", 0)
_collective(("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
            "reduce_scatter", 1)  # fmt: skip
_collective(("reduce_scatter",), "reduce_scatter", 1)
_collective(("all_reduce", "all_reduce_coalesced"), "all_reduce", 0, times=2)
_collective(("reduce",), "reduce", 0)
_collective(("broadcast",), "broadcast", 0)
_collective(("all_to_all_single",), "all_to_all", 1)


class CommCounter:
    """Bytes per collective kind issued through ``torch.distributed`` since :meth:`reset`.

    :meth:`install` rebinds the collectives in ``torch.distributed`` and in its
    ``distributed_c10d`` module (deprecated aliases call the new names through the latter);
    a collective called from inside another counted one is not counted again.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = threading.local()

    def install(self) -> CommCounter:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for module in (dist, distributed_c10d):
            for name, (kind, count) in _COLLECTIVES.items():
                original = getattr(module, name, None)
                if original is not None and not hasattr(original, "__counted__"):
                    setattr(module, name, self._wrap(original, kind, count))
        return self

    def _wrap(self, original: Callable, kind: str, count: Callable[..., int]) -> Callable:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.calls[kind] += 1
                self.bytes[kind] += count(*args, *kwargs.values())
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth

        counted.__counted__ = True
        return counted

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


def zero_formula_bytes(
    stage: int, numel: int, gather_itemsize: int, reduce_itemsize: int, world_size: int
) -> dict[str, int]:
    """Bytes per optimizer step and rank that ZeRO stage ``stage`` must move for ``numel``
    parameters (gathered and reduced in dtypes of the given sizes), counted as
    :class:`CommCounter` counts: stage 0 all-reduces the gradients (2Ψ); stages 1-2
    reduce-scatter them and all-gather the updated parameters (Ψ + Ψ); stage 3 gathers the
    parameters for forward and again for backward (2Ψ) and reduce-scatters the gradients (Ψ)."""
    if world_size == 1:
        return {}
    if stage == 0:
        return {"all_reduce": 2 * numel * reduce_itemsize}
    gathers = 2 if stage == 3 else 1
    return {
        "all_gather": gathers * numel * gather_itemsize,
        "reduce_scatter": numel * reduce_itemsize,
    }


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (since start, or the last :func:`reset_peak_rss`)."""
    return _status_kib("VmHWM") * 1024


def release_free_memory() -> None:
    """Give the memory glibc's allocator keeps in its free lists back to the system (a no-op
    elsewhere): the resident memory of an idle process drops to what it has live."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Restart the peak at the current resident memory; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
