"""The link's rates, measured: collectives timed on the plan's process group and fitted to the
ring model of :mod:`zerocc.cost.model`, and the share of a transfer that runs beside compute
(steps 3 and 4 of :mod:`zerocc.inspect.calibrate`)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerocc.compiler.plan import Plan
from zerocc.cost.fit import nnls
from zerocc.cost.model import CostModel, ring_hops
from zerocc.cost.rates import DeviceRates
from zerocc.engine.comm import Comm

MESSAGE_BYTES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)  # per rank
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collectives(
    comm: Comm, plan: Plan, device: torch.device, sizes: Sequence[int] = MESSAGE_BYTES,
    reps: int = 5,
) -> list[dict[str, Any]]:  # fmt: skip
    """Median seconds of each collective kind and size on ``comm``, from issue to the end of its
    wait, ranks lined up by a barrier before each; ``bytes`` as ZeRO counts them (logical)."""
    n = comm.world_size
    dtypes = {
        "all_gather": plan.precision.dtype("param"),
        "reduce_scatter": plan.precision.dtype("reduce"),
        "all_reduce": plan.precision.dtype("reduce"),
    }
    samples = []
    for kind, size in itertools.product(KINDS, sizes):
        dtype = dtypes[kind]
        numel = max(n, size // dtype.itemsize // n * n)  # per rank, divisible by the ranks
        full = torch.ones(numel, dtype=dtype, device=device)
        part = torch.ones(numel // n, dtype=dtype, device=device)
        seconds = []
        for _ in range(reps + 1):  # the first warms the group's buffers up: not kept
            _barrier(comm, device)
            start = time.perf_counter()
            if kind == "all_gather":
                work = comm.all_gather(full, part)
            elif kind == "reduce_scatter":
                work = comm.reduce_scatter(part, full)
            else:
                work = comm.all_reduce(full)
            work.wait()
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        logical = full.numel() * dtype.itemsize * (2 if kind == "all_reduce" else 1)
        samples.append({"kind": kind, "bytes": logical, "ranks": n,
                        "seconds": statistics.median(seconds[1:])})  # fmt: skip
    return samples


def _barrier(comm: Comm, device: torch.device) -> None:
    synchronize(device)
    if dist.is_initialized() and comm.world_size > 1:
        dist.barrier(group=getattr(comm, "group", None))


def measure_overlap(comm: Comm, plan: Plan, device: torch.device, reps: int = 9) -> dict[
        str, float]:  # fmt: skip
    """How much of a collective's transfer runs alongside compute: an all-gather of 32 MiB
    (``M``) and matmuls of about as long (``C``), timed alone and together (``T``), in turn,
    ``reps`` times; ``overlap = (C + M - T) / min(C, M)`` (the median over the rounds): 1 when
    together they take as long as the longer, 0 when as long as both one after the other (a
    CPU whose cores compute and copy alike)."""
    dtype = plan.precision.dtype("param")
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # CPU fp16 matmuls are too slow to say anything
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    numel = (32 << 20) // dtype.itemsize // comm.world_size * comm.world_size
    full = torch.empty(numel, dtype=dtype, device=device)
    part = torch.ones(numel // comm.world_size, dtype=dtype, device=device)

    def matmuls(count: int) -> None:
        for _ in range(count):
            torch.mm(a, a)

    def timed(fn: Any) -> float:
        _barrier(comm, device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    def gather() -> None:
        comm.all_gather(full, part).wait()

    timed(lambda: matmuls(1))  # warm-up
    timed(gather)
    one = statistics.median(timed(lambda: matmuls(1)) for _ in range(3))
    m = statistics.median(timed(gather) for _ in range(3))
    count = int(slowest(comm, [float(max(1, round(m / one)))], device)[0])  # same on all

    def both() -> None:
        work = comm.all_gather(full, part)
        matmuls(count)
        work.wait()

    rounds = []
    for _ in range(reps):
        c, m, t = timed(lambda: matmuls(count)), timed(gather), timed(both)
        rounds.append((c, m, t, (c + m - t) / min(c, m)))
    c, m, t, overlap = (statistics.median(r[i] for r in rounds) for i in range(4))
    overlap = min(1.0, max(0.0, overlap))
    return {"compute_s": c, "comm_s": m, "together_s": t, "overlap": overlap}


def fit_link(samples: Sequence[dict[str, Any]], base: DeviceRates) -> tuple[DeviceRates, dict[
        str, Any]]:  # fmt: skip
    """Fit latency per hop and link bytes/s to timed collectives (the ring model of
    :mod:`zerocc.cost.model`; errors relative to each size's time): one fit over all kinds (the
    link), and one per kind (a backend may run some kinds less well than a ring)."""
    if not samples or samples[0]["ranks"] < 2:
        return base, {"timed": len(samples), "samples": [], "median_error_pct": 0.0}
    timed, samples = len(samples), _trimmed(samples)
    latency, link = _fit_ring(samples)
    kinds = {}
    for kind in sorted({s["kind"] for s in samples}):
        fitted = _fit_ring([s for s in samples if s["kind"] == kind])
        if fitted[1] is not None:
            kinds[kind] = {"latency_s": fitted[0], "link_bytes_per_s": fitted[1]}
    rates = base.replace("calibration", latency_s=latency, link_bytes_per_s=link, collectives=kinds)
    model = CostModel(rates, samples[0]["ranks"])
    groups: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        groups[s["kind"], s["bytes"], s["ranks"], bool(s.get("in_program"))].append(s["seconds"])
    summary = []
    for (kind, nbytes, ranks, in_program), seconds in sorted(groups.items()):
        predicted = model.collective_time(kind, nbytes, ranks)
        summary.append({"kind": kind, "bytes": nbytes, "ranks": ranks, "in_program": in_program,
                        "count": len(seconds), "median_s": statistics.median(seconds),
                        "mean_s": statistics.fmean(seconds), "predicted_s": predicted})  # fmt: skip
    errors = [abs(g["predicted_s"] / g["mean_s"] - 1) * 100 for g in summary]
    return rates, {"timed": timed, "samples": summary,
                   "median_error_pct": statistics.median(errors)}  # fmt: skip


def _trimmed(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples less the slowest tenth of each kind and size with ten or more: a busy
    machine's outliers, not the rank skew every step pays."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        groups[s["kind"], s["bytes"], s["ranks"]].append(s)
    kept = []
    for group in groups.values():
        group = sorted(group, key=lambda s: s["seconds"])
        kept += group[: len(group) - len(group) // 10]
    return kept


def _fit_ring(samples: Sequence[dict[str, Any]]) -> tuple[float, float | None]:
    """(latency per hop, link bytes/s or None when the bytes explain nothing). Each sample is
    weighted by 1 / the median time of its kind and size: relative errors across sizes, but
    the mean within a size, as a step adds the times of its collectives (in a program, rank
    skew makes some of them wait for the other ranks)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        groups[s["kind"], s["bytes"], s["ranks"]].append(s["seconds"])
    rows, targets = [], []
    for s in samples:
        n = s["ranks"]
        weight = 1 / max(statistics.median(groups[s["kind"], s["bytes"], n]), 1e-9)
        rows.append([ring_hops(s["kind"], n) * weight, (n - 1) / n * s["bytes"] * weight])
        targets.append(s["seconds"] * weight)
    latency, per_byte = nnls(rows, targets)
    return latency, (1 / per_byte if per_byte > 0 else None)


def slowest(comm: Comm, values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over ranks (a tensor on ``device``: NCCL reduces only GPU ones)."""
    if not dist.is_initialized() or comm.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=getattr(comm, "group", None))
    return t.tolist()
