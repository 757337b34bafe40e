"""`zerocc profile PLAN`: measure this machine and fit the cost model's rates to it.

On every rank of the plan (launched as ``zerocc train`` launches them), the plan's workload is
compiled and warmed up, then:

1. **steps**: ``steps`` optimizer steps are timed as they run (a step lasts as long as its
   slowest rank; the median is kept): what the prediction is checked against;
2. **ops**: a few more steps run op by op (``TrainStep.profile`` with :class:`CalibrationRun`,
   lowered by the eager backend whatever the plan's, so that every op of the program is timed,
   not a compiled region as one call; each collective finishes when it is issued, so no op
   shares the cores or the memory bus with a transfer; on a GPU every op is synchronized, so
   its time is its kernels'; each op's least time over the runs is kept). Views, which do no
   work, time the profiler's own cost per op, taken off every op; the rest is fitted, by
   non-negative least squares, to ``flops / F[dtype]`` (compute-bound ops) or ``bytes / B``
   (the others; which term an op falls under is the roofline's ``max``, iterated to a fixed
   point). The per-op overhead the model keeps is the plan's backend's: the program run as
   that backend runs it (its generated code: :class:`EagerRun`, collectives again one at a
   time and timed apart) takes, per op of the program, this much beyond the work the fitted
   rates explain (at most the profiler's own per-op cost; none when compiled code takes less,
   or when the fitted rates already explain the whole run);
3. **collectives**: all-gather, reduce-scatter and all-reduce on the plan's process group,
   from 64 KiB to 32 MiB per rank, in the plan's dtypes (gathers in the compute dtype,
   reductions in the reduce dtype), each timed from issue to the end of its wait, together
   with every collective of the program as step 2 ran it, are fitted to the ring model of
   :mod:`zerocc.cost.model` (latency per hop, link bandwidth; relative errors, so that small and
   large messages count alike), over all kinds and per kind;
4. **overlap**: a transfer and matmuls timed alone and together give the share of a transfer
   that runs alongside compute (:func:`measure_overlap`);
5. **offload** (a plan that offloads its optimizer, on a GPU): the host's update and the copies
   between host and device (:mod:`zerocc.inspect.host_rates`).

Rank 0's rates are every rank's; rank 0 writes them and what was measured (device, world size,
the median step and the simulator's prediction of it with the fitted rates) with
:meth:`DeviceRates.save`.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx

from zerocc.cost.fit import nnls
from zerocc.cost.memory import model_state_bytes_of
from zerocc.cost.model import COMPUTE, CostModel, NodeWork, node_work
from zerocc.cost.rates import DeviceRates
from zerocc.cost.simulate import Simulation, predict_step
from zerocc.engine.comm import Comm, Work
from zerocc.inspect.host_rates import host_link_rate, host_update_rate
from zerocc.inspect.link_rates import (
    fit_link,
    measure_overlap,
    slowest,
    synchronize,
    time_collectives,
)
from zerocc.runtime.measure import ProfiledRun
from zerocc.runtime.rank import to_device

if TYPE_CHECKING:
    from zerocc.backends import Executable
    from zerocc.runtime.step import StepRunner as TrainStep


def default_output(plan_path: str | os.PathLike[str]) -> Path:
    """Where ``zerocc profile PLAN`` writes: ``<plan stem>.calibration.json`` next to the plan,
    so that ``cost: {calibration: <plan stem>.calibration.json}`` in the plan finds it."""
    path = Path(plan_path)
    return path.with_name(f"{path.stem}.calibration.json")


@dataclass
class Calibration:
    """What one calibration measured and the rates fitted to it."""

    rates: DeviceRates
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_step_ms(self) -> float:
        return self.measured["step_ms"]["measured"]

    @property
    def predicted_step_ms(self) -> float:
        return self.measured["step_ms"]["predicted"]

    def save(self, path: str | os.PathLike[str]) -> None:
        self.rates.save(path, self.measured)

    def table(self) -> str:
        """A short report: the fitted rates, the fits' quality, measured vs predicted step."""
        r, m = self.rates, self.measured
        flops = ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(r.compute_flops.items()))
        ops, link = m["ops"], m["collectives"]
        step = m["step_ms"]
        lines = [
            f"calibration of {m['device']}, {m['world_size']} rank(s), "
            f"{m['threads']} thread(s) per rank",
            f"  compute        {flops} GFLOP/s  ({ops['fitted']}: from {ops['nodes']} ops)",
            f"  memory         {r.memory_bytes_per_s / 1e9:.2f} GB/s",
            f"  overhead       {r.overhead_s * 1e6:.1f} us per op",
            f"  ops            measured {ops['measured_ms']:.1f} ms, fitted "
            f"{ops['fitted_ms']:.1f} ms a step (sum over ops)",
            f"  link           {r.link_bytes_per_s * 8 / 1e9:.2f} Gbit/s "
            f"({r.link_bytes_per_s / 1e9:.2f} GB/s), latency {r.latency_s * 1e6:.1f} us per hop",
            f"  collectives    {link['timed']} timed, median error "
            f"{link['median_error_pct']:.0f}%; {100 * r.comm_overlap:.0f}% of a transfer "
            "overlaps compute",
            f"  step           measured {step['measured']:.1f} ms (median of {step['steps']}), "
            f"predicted {step['predicted']:.1f} ms ({step['error_pct']:+.0f}%)",
        ]
        if "offload" in m:
            update = m["offload"]["host_update"]
            lines.insert(-1, (
                f"  host           update {r.host_memory_bytes_per_s / 1e9:.1f} GB/s "
                f"({update['kernels']}: {update['seconds'] * 1e3:.1f} ms for "
                f"{update['numel']:,} elements), link {r.host_link_bytes_per_s / 1e9:.1f} GB/s"
            ))  # fmt: skip
        return "\n".join(lines)


# --- compute ------------------------------------------------------------------------------------


def op_samples(recorders: Sequence[ProfiledRun]) -> list[tuple[NodeWork, float]]:
    """(work, least seconds) of each compute node the recorders timed (waits left out): a busy
    machine only ever adds time, as :func:`eager_overhead`, which these times are set against,
    also takes the least."""
    times: dict[fx.Node, list[float]] = defaultdict(list)
    for recorder in recorders:
        by_name = {n.name: n for n in recorder.module.graph.nodes}
        for event in recorder.events:
            node = by_name.get(event.args.get("node", ""))
            if event.track != "compute" or event.args.get("exposed") or node is None:
                continue
            if node_work(node).kind == COMPUTE:
                times[node].append(event.duration_us * 1e-6)
    return [(node_work(n), min(ts)) for n, ts in times.items()]


def fit_compute(
    samples: Sequence[tuple[NodeWork, float]], base: DeviceRates
) -> tuple[DeviceRates, dict[str, Any]]:
    """Fit FLOP/s per dtype and memory bytes/s to per-op times (module docs); rates the samples
    cannot tell (no op of that kind) keep ``base``'s.

    Ops that do no work (views) time what running any op costs where it was measured (the
    profiler's interpreter included): their median is the overhead, taken from every op before
    the rates are fitted. Without such ops the overhead is the fit's intercept."""
    idle = [t for w, t in samples if not w.flops and not w.bytes]
    profiled = statistics.median(idle) if len(idle) >= 5 else None
    busy = [(w, t) for w, t in samples if w.flops or w.bytes] if profiled is not None else samples
    dtypes = sorted({w.dtype or "fp32" for w, _ in busy if w.flops})
    rates = base
    coef: list[float] = []
    for _ in range(5):  # classify by the current rates' roofline, refit, until stable
        rows = []
        for work, _ in busy:
            bound = work.flops / rates.flops_per_s(work.dtype) > work.bytes / (
                rates.memory_bytes_per_s
            )
            flops = [work.flops if bound and (work.dtype or "fp32") == d else 0.0 for d in dtypes]
            intercept = [1.0] if profiled is None else []
            rows.append([*intercept, *flops, 0.0 if bound else float(work.bytes)])
        new = nnls(rows, [t - (profiled or 0.0) for _, t in busy])
        if new == coef:
            break
        coef = new
        fitted = coef if profiled is None else [profiled, *coef]
        flops = {d: 1 / c for d, c in zip(dtypes, fitted[1:-1], strict=True) if c > 0}
        rates = base.replace(
            "calibration",
            overhead_s=fitted[0],
            compute_flops=flops or None,
            memory_bytes_per_s=1 / fitted[-1] if fitted[-1] > 0 else None,
        )
    model = CostModel(rates, 1)
    fitted_s = sum(model.compute_time(w.flops, w.bytes, w.dtype) for w, _ in samples)
    stats = {
        "nodes": len(samples),
        "measured_ms": 1e3 * sum(t for _, t in samples),
        "fitted_ms": 1e3 * fitted_s,
        "profiled_overhead_us": 1e6 * rates.overhead_s,
        "fitted": ("overhead, " if profiled is None else "")
        + ", ".join(f"{d} FLOP/s" for d in dtypes)
        + ", memory",
    }
    return rates, stats


def eager_overhead(runs: Sequence[EagerRun], rates: DeviceRates) -> float | None:
    """Seconds per op of the backend's generated code (eager's, or Inductor's): what the
    program's compute took (its run, less its collectives, each run alone) beyond the work the
    fitted rates explain, per compute op of the program. The least over ``runs`` (a busy
    machine only ever adds time), and at most ``rates.overhead_s``, the profiler's per-op
    cost, which runs the same ops and more (None without runs)."""
    per_op = []
    for run in runs:
        model = CostModel(rates.replace("calibration", overhead_s=0.0), 1)
        works = [node_work(n) for n in run.program.graph.nodes if node_work(n).kind == COMPUTE]
        work_s = sum(model.compute_time(w.flops, w.bytes, w.dtype) for w in works)
        comm_s = sum(c["seconds"] for c in run.collectives)
        per_op.append((run.seconds - comm_s - work_s) / max(len(works), 1))
    return min(max(0.0, min(per_op)), rates.overhead_s) if per_op else None


# --- the whole calibration ----------------------------------------------------------------------


class _SerialComm(Comm):
    """The step's comm, each collective finished (and timed) before it returns: a calibration
    run times every op with no transfer running beside it, and every collective of the real
    program alone."""

    def __init__(self, inner: Comm, device: torch.device, samples: list[dict[str, Any]]) -> None:
        super().__init__()
        self.inner, self.device, self.samples = inner, device, samples
        self.rank, self.world_size = inner.rank, inner.world_size

    def _timed(self, kind: str, nbytes: int, issue: Any) -> Work:
        synchronize(self.device)
        start = time.perf_counter()
        issue().wait()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.samples.append({"kind": kind, "bytes": nbytes, "ranks": self.world_size,
                             "seconds": seconds, "in_program": True})  # fmt: skip
        return Work()

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        nbytes = out.numel() * out.element_size()
        return self._timed("all_gather", nbytes, lambda: self.inner.all_gather(out, shard))

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        nbytes = full.numel() * full.element_size()
        return self._timed("reduce_scatter", nbytes, lambda: self.inner.reduce_scatter(out, full))

    def _all_reduce(self, tensor: torch.Tensor) -> Work:
        nbytes = 2 * tensor.numel() * tensor.element_size()
        return self._timed("all_reduce", nbytes, lambda: self.inner.all_reduce(tensor))


class _SerialRun(ProfiledRun):
    """A run on a comm whose collectives finish when issued (:class:`_SerialComm`), which
    times each of them into ``collectives``."""

    def __init__(
        self,
        executable: Executable,
        rank: int,
        model_states: dict[str, int],
        collectives: list[dict[str, Any]],
        program: fx.GraphModule | None = None,
    ) -> None:
        super().__init__(executable, rank, model_states, program)
        self.collectives = collectives


class EagerRun(_SerialRun):
    """The program run as the backend's executable runs it (its generated code, not op by op):
    ``seconds`` is its compute plus its collectives in turn. Records no events."""

    seconds = 0.0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        synchronize(device)
        start = time.perf_counter()
        result = self.executable(*args)
        synchronize(device)
        self.seconds = time.perf_counter() - start
        return result


class CalibrationRun(_SerialRun):
    """A profiled run for fitting: no op shares the machine with a transfer (collectives finish
    when issued); on a GPU the compute stream is synchronized after every op, so an op's time
    is its kernels', not their launch's."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        result = super().call_function(target, args, kwargs)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        return result


def calibrate(
    step: TrainStep, batches: Iterator[Sequence[Any]], *, steps: int = 5, warmup: int = 2,
    profiled: int = 3,
) -> Calibration:  # fmt: skip
    """Measure ``step`` (a compiled TrainStep, ranks joined) on ``batches`` and fit the rates
    (module docs): ``warmup`` untimed optimizer steps, ``steps`` timed, ``profiled`` run op by
    op. Call on every rank (it runs collectives); every rank returns rank 0's calibration."""
    runs = _StepRuns(step, batches)
    for _ in range(warmup):
        runs.one_step()
    times = slowest(step.comm, [runs.timed_step() for _ in range(steps)], step.device)
    # Every op timed: the eager binding, whatever the plan's backend compiled (a region of
    # Inductor's is one call); the overhead then from the backend's own code, run whole.
    recorders = [r for _ in range(profiled) for r in runs.one_step(CalibrationRun, "eager")]
    eager = [r for _ in range(2 * profiled) for r in runs.one_step(EagerRun)]  # at full speed
    rates, measured = _fit_rates(step, recorders, eager)
    predicted = _predicted_step_s(step, rates)
    measured_ms, predicted_ms = 1e3 * statistics.median(times), predicted.step_s * 1e3
    measured["step_ms"] = {
        "measured": measured_ms,
        "steps": steps,
        "all": [1e3 * t for t in times],
        "predicted": predicted_ms,
        "error_pct": 100 * (predicted_ms / measured_ms - 1),
        "predicted_exposed_comm_ms": predicted.exposed_s * 1e3,
    }
    return Calibration(rates, measured)


class _StepRuns:
    """Optimizer steps of ``step`` on ``batches``: plain, timed, or profiled op by op on a comm
    whose collectives finish when issued (one comm: the step keeps what it lowers for it)."""

    def __init__(self, step: TrainStep, batches: Iterator[Sequence[Any]]) -> None:
        self.step, self.batches = step, batches
        self.serial = _SerialComm(step.comm, step.device, [])

    def one_step(
        self, recorder: type[_SerialRun] | None = None, backend: str | None = None
    ) -> list[Any]:
        """One optimizer step (``grad_accumulation`` batches); the recorders, if profiled."""
        step, recorders = self.step, []
        for _ in range(step.plan.grad_accumulation):
            batch = to_device(next(self.batches), step.device)
            if recorder is None:
                float(step(*batch))
                continue
            timed: list[dict[str, Any]] = []  # each collective of the run, alone
            self.serial.samples = timed
            make = functools.partial(recorder, collectives=timed)
            recorders.append(
                step.profile(*batch, recorder=make, comm=self.serial, backend=backend)[1]
            )
        synchronize(step.device)
        return recorders

    def timed_step(self) -> float:
        """Seconds of one optimizer step on this rank."""
        start = time.perf_counter()
        self.one_step()
        return time.perf_counter() - start


def _fit_rates(
    step: TrainStep, recorders: list[Any], eager: list[EagerRun]
) -> tuple[DeviceRates, dict[str, Any]]:
    """The rates fitted to the profiled runs, the timed collectives and (a plan whose updates
    run on the host) the host's update and link; rank 0's on every rank, with what was
    measured."""
    plan, comm, device = step.plan, step.comm, step.device
    # Rank 0's ops stand for all: every rank runs the same program on as much data.
    rates, ops = fit_compute(op_samples(recorders), DeviceRates.defaults(device.type))
    overhead = eager_overhead(eager, rates)
    if overhead is not None:
        rates = rates.replace("calibration", overhead_s=overhead)
    ops["overhead_us"] = rates.overhead_s * 1e6
    in_program = [c for r in recorders + eager for c in r.collectives]
    swept = time_collectives(comm, plan, device) if comm.world_size > 1 else []
    rates, links = fit_link(swept + in_program, rates)
    if comm.world_size > 1:
        links["overlap"] = measure_overlap(comm, plan, device)
        rates = rates.replace("calibration", comm_overlap=links["overlap"]["overlap"])
    measured = {
        "device": _device_name(device),
        "world_size": comm.world_size,
        "threads": torch.get_num_threads(),
        "plan": plan.source,
        "stage": plan.zero.stage,
        "ops": ops,
        "collectives": links,
    }
    if plan.offload.updates_on_host(device):
        offload = {
            "host_update": host_update_rate(),
            "host_link_bytes_per_s": host_link_rate(device),
        }
        rates = rates.replace(
            "calibration",
            host_memory_bytes_per_s=offload["host_update"]["bytes_per_s"],
            host_link_bytes_per_s=offload["host_link_bytes_per_s"],
        )
        measured["offload"] = offload
    return _agree(comm, rates), measured


def _predicted_step_s(step: TrainStep, rates: DeviceRates) -> Simulation:
    """The simulator's prediction of ``step``'s optimizer step with ``rates``."""
    world_size = step.comm.world_size
    return predict_step(
        step.record().programs,
        step.plan.grad_accumulation,
        rates,
        world_size,
        model_states=model_state_bytes_of(step.layout),
        mesh=step.mesh,
    )


def _agree(comm: Comm, rates: DeviceRates) -> DeviceRates:
    """Rank 0's rates on every rank (each rank fitted its own; they would differ by noise)."""
    if not dist.is_initialized() or comm.world_size == 1:
        return rates
    box = [rates]
    dist.broadcast_object_list(box, src=0, group=getattr(comm, "group", None))
    return box[0]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
