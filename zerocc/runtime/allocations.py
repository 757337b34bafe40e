"""The peak of tensor memory a run really allocates, whatever code runs it.

:class:`~zerocc.runtime.measure.ProfiledRun` measures a program op by op, as the eager backend
runs it. Code that runs it otherwise (Inductor's, which plans its own buffers; a peer's, in the
benchmarks) is measured here, from the allocator: on a GPU its peak statistic; on a CPU, whose
allocator keeps none, the allocations ``torch.profiler`` records (``profile_memory``), summed in
the order they happened. The CPU figure counts the allocations of the threads the profiler
follows (the calling one and the collectives' workers; not gloo's own buffers, which are not
torch tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch._C._profiler import _EventType

T = TypeVar("T")


def peak_allocated(
    run: Callable[[], T], device: torch.device, trace: Path | None = None
) -> tuple[T, int]:
    """Call ``run()`` once; returns its result and the most bytes of tensor memory on
    ``device`` held at once during the call beyond what was held when it began. ``trace``:
    where to write the call's ``torch.profiler`` trace (Chrome/Perfetto JSON: its ops, and on a
    GPU its kernels, as they ran)."""
    cpu = torch.profiler.ProfilerActivity.CPU
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        activities = [cpu, torch.profiler.ProfilerActivity.CUDA]
        profiler = torch.profiler.profile(activities=activities) if trace else None
        with profiler if profiler is not None else contextlib.nullcontext():
            result = run()
            torch.cuda.synchronize(device)
        _export(profiler, trace)
        return result, torch.cuda.max_memory_allocated(device) - before
    profiler = torch.profiler.profile(activities=[cpu], profile_memory=True)
    with profiler:
        result = run()
    _export(profiler, trace)
    return result, _peak_of(profiler, device)


def _export(profiler: torch.profiler.profile | None, trace: Path | None) -> None:
    """Write ``profiler``'s trace to ``trace`` (nothing without either)."""
    if profiler is not None and trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))


def _peak_of(profiler: torch.profiler.profile, device: torch.device) -> int:
    """The most bytes the profiled run's allocations on ``device`` held at once."""
    sizes = sorted(
        (event.start_time_ns, event.extra_fields.alloc_size)
        for root in profiler.profiler.kineto_results.experimental_event_tree()
        for event in _walk(root)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == device.type
    )
    held = peak = 0
    for _, size in sizes:  # an allocation's size is positive, a free's negative
        held += size
        peak = max(peak, held)
    return peak


def _walk(event: Any) -> Iterator[Any]:
    """``event`` and every event under it in the profiler's tree."""
    yield event
    for child in event.children:
        yield from _walk(child)
