"""`zerocc inspect` and `zerocc estimate` run: the plan's workload compiled for ``--world-size``
simulated ranks, and what is printed of it (the commands' arguments: :mod:`zerocc.cli.inspect`,
which imports this module only when one of them runs, so that `zerocc --help` needs no torch).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from zerocc.cli.plan_args import plan_of
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.parallel.mesh import mesh_lines
from zerocc.compiler.parallel.router_loss import router_loss_lines
from zerocc.compiler.plan import OffloadConfig, Plan
from zerocc.cost.rates import RATE_FIELDS, DeviceRates, rates_for
from zerocc.cost.simulate import Simulation
from zerocc.errors import ZeroccError
from zerocc.inspect.estimate import Estimate, Inspection, estimate, inspect_plan, pass_table
from zerocc.inspect.explain import describe_recompute, held_gradients_line, no_communication
from zerocc.ir.ops import TO_HOST
from zerocc.ir.printing import format_program, program_to_json
from zerocc.ir.quantities import human_bytes, human_seconds


def _inspection(args: argparse.Namespace, plan: Plan | None = None) -> Inspection:
    plan = plan or plan_of(args)
    world_size = args.world_size or plan.least_world_size()
    if world_size < 1:
        raise ZeroccError("--world-size must be at least 1")
    # The graph after each pass is kept only for the options that print one: copying it after
    # every pass was a fifth of the command's time.
    shown = [getattr(args, name, None) for name in ("diff", "print_after", "print_before")]
    return inspect_plan(plan, world_size, keep_graphs=any(shown))


# --- inspect ----------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace, plan: Plan) -> int:
    """``zerocc inspect`` of ``plan`` (the command's): the pass table, or one program printed,
    or one pass's diff, or what the plan's backend makes of the program (``--lowered``); for a
    pipeline plan, its cut and schedule."""
    if plan.parallel.pp > 1:
        return _inspect_pipeline(args, plan)
    if args.schedule:
        raise ZeroccError("--schedule: a plan without a pipeline has none (parallel.pp: 1)")
    inspection = _inspection(args, plan)
    records = inspection.stepping.records
    if args.unit is not None and args.unit not in {u.name for u in inspection.units}:
        names = ", ".join(u.name for u in inspection.units)
        raise ZeroccError(f"--unit {args.unit!r}: no such unit; units: {names}")
    if args.lowered is not None:
        print(_lowered_text(inspection, Path(args.lowered) if args.lowered else None))
    elif args.diff:
        before, after = _around(records, args.diff)
        print(_diff(before, after, args.unit), end="")
    elif args.print_after == "all":
        for record in records:
            print(_show(record, args.format, args.unit))
    elif args.print_after or args.print_before:
        before, after = _around(records, args.print_after or args.print_before)
        print(_show(after if args.print_after else before, args.format, args.unit))
    else:
        print(_pass_table_text(inspection))
    return 0


def _inspect_pipeline(args: argparse.Namespace, plan: Plan) -> int:
    from zerocc.inspect.pipeline import inspect_pipeline

    shown = ("diff", "print_after", "print_before", "unit")
    asked = [f"--{name.replace('_', '-')}" for name in shown if getattr(args, name)]
    if asked or args.lowered is not None:
        raise ZeroccError(
            f"{' '.join(asked) or '--lowered'}: not for a pipeline plan yet (parallel.pp > 1); "
            "`zerocc inspect PLAN` shows its cut and schedule"
        )
    world_size = args.world_size or plan.zero.world_size or plan.parallel.pp
    inspection = inspect_pipeline(plan, world_size)
    print(inspection.schedule.format() if args.schedule else inspection.format())
    return 0


def _lowered_text(inspection: Inspection, folder: Path | None) -> str:
    """The backend's notes and its table of regions; what it generated written to ``folder``."""
    from zerocc.inspect.lowering import lower

    backend, executable = lower(inspection)
    files = executable.artifacts()
    lines = [f"backend {backend}:", *executable.notes()]
    if "regions.txt" in files:
        lines += ["", files["regions.txt"].rstrip()]
    if not files and not executable.notes():
        lines.append("  runs the program op by op, as printed: nothing generated")
    if folder is not None and files:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        lines += ["", f"wrote {len(files)} file(s) to {folder}"]
    return "\n".join(lines)


def _around(records: list[PassRecord], name: str) -> tuple[PassRecord, PassRecord]:
    """The records before and after pass ``name`` (the first is the captured program)."""
    names = [r.name for r in records]
    if name not in names[1:]:
        raise ZeroccError(f"no pass {name!r} in this pass list; passes: {', '.join(names[1:])}")
    i = names.index(name)
    return records[i - 1], records[i]


def _show(record: PassRecord, fmt: str, unit: str | None) -> str:
    header = record.header
    if fmt == "json":
        return json.dumps(program_to_json(record.gm, header, unit), indent=1)
    if fmt == "dot":
        from zerocc.inspect.dot import program_to_dot

        return program_to_dot(record.gm, header, unit)
    return format_program(record.gm, header, unit)


def _diff(before: PassRecord, after: PassRecord, unit: str | None) -> str:
    """The printed programs' unified diff, headers (which carry timings) left out."""
    old = format_program(before.gm, only_unit=unit).splitlines(keepends=True)
    new = format_program(after.gm, only_unit=unit).splitlines(keepends=True)
    return "".join(
        difflib.unified_diff(old, new, f"before {after.name}", f"after {after.name}", n=1)
    )


def _pass_table_text(inspection: Inspection) -> str:
    plan, records = inspection.plan, inspection.stepping.records
    rows = pass_table(records)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"{plan.source or 'plan'}: ZeRO stage {plan.zero.stage}, {inspection.world_size} ranks, "
        f"{len(inspection.units)} units; the program of a step that runs the optimizer",
        "",
    ]
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w) for i, (c, w) in
                 enumerate(zip(row, widths, strict=True))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    said = router_loss_lines([inspection.stepping.gm], plan.grad_accumulation,
                             inspection.mesh.data_parallel,
                             pipeline=False)  # fmt: skip
    return "\n".join([*lines, *([""] + said if said else [])])


# --- estimate ---------------------------------------------------------------------------------


def run_estimate(args: argparse.Namespace, plan: Plan) -> int:
    """``zerocc estimate`` of ``plan`` (the command's): per-rank memory, bytes and time per
    step, for one stage or all four."""
    for flag in ("link_gbps", "latency_us"):
        value = getattr(args, flag)
        if value is not None and (value < 0 or (flag == "link_gbps" and value == 0)):
            raise ZeroccError(f"--{flag.replace('_', '-')} must be positive, not {value:g}")
    rates = rates_for(plan, args.device, args.calibration).replace(
        "flags",
        link_bytes_per_s=args.link_gbps * 1e9 / 8 if args.link_gbps else None,
        latency_s=args.latency_us * 1e-6 if args.latency_us is not None else None,
    )
    no_gpu_here = plan.backend.device == "auto" and rates.device == "cpu"
    if args.device is None and args.calibration is None and no_gpu_here:
        print("zerocc: note: cpu rates (backend.device: auto, and this machine has no GPU); "
              "--device cuda predicts a GPU's step", file=sys.stderr)  # fmt: skip
    if plan.parallel.pp > 1:
        return _estimate_pipeline(args, plan, rates)
    if args.table:
        estimates = [
            estimate(_inspection(args, _with_stage(plan, stage)), rates)
            for stage in _stages_for(plan)
        ]
        if args.json:
            print(json.dumps([e.as_dict() for e in estimates], indent=2))
        else:
            print(_estimate_table(plan, estimates))
        return 0
    result = estimate(_inspection(args, plan), rates)
    print(json.dumps(result.as_dict(), indent=2) if args.json else _estimate_text(plan, result))
    return 0


def _estimate_pipeline(args: argparse.Namespace, plan: Plan, rates: DeviceRates) -> int:
    from zerocc.inspect.pipeline_estimate import estimate_pipeline

    if args.table:
        raise ZeroccError("--table: not for a pipeline plan yet (parallel.pp > 1)")
    world_size = args.world_size or plan.zero.world_size or plan.parallel.pp
    result = estimate_pipeline(plan, world_size, rates=rates)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.format())
    return 0


def _stages_for(plan: Plan) -> list[int]:
    """The stages the plan's offload section allows (optimizer offload: 1-3; params: 3)."""
    if plan.offload.params != "none":
        return [3]
    return [1, 2, 3] if plan.offload.optimizer != "none" else [0, 1, 2, 3]


def _with_stage(plan: Plan, stage: int) -> Plan:
    """``plan`` at ``stage`` (stage 0 without replicas: it shards nothing to replicate)."""
    zero = {"stage": stage} | ({"replicate": 1} if stage == 0 else {})
    copy = plan.model_copy(update={"zero": plan.zero.model_copy(update=zero)})
    copy._source = plan.source
    return copy


GLOO_ROW = "gloo buffers (peak)"  # (shown where there are any: ranks on gloo)
ROWS = (
    ("params", lambda e: e.model_states.get("params", 0)),
    ("grads", lambda e: e.model_states.get("grads", 0)),
    ("optimizer states", lambda e: e.model_states.get("optimizer", 0)),
    ("model states", lambda e: e.model_states["total"]),
    ("  + in host memory", lambda e: e.offloaded["host"]),
    ("  + on NVMe", lambda e: e.offloaded["nvme"]),
    ("gathered units (peak)", lambda e: e.peak["gathered"]),
    ("activations (peak)", lambda e: e.peak["activations"]),
    (GLOO_ROW, lambda e: e.peak["comm"]),
    ("peak", lambda e: e.peak["total"]),
    ("  + host buffers (peak)", lambda e: e.peak["host_buffers"]),
)


def _shown(
    name: str, plan: Plan, estimates: list[Estimate], get: Callable[[Estimate], int]
) -> bool:
    """Whether a row of :data:`ROWS` is shown: offload's where the plan offloads, gloo's
    where an estimate has its buffers (ranks on a GPU have none), the others always."""
    if name.startswith("  +"):
        return plan.offload.enabled
    return name != GLOO_ROW or any(get(e) for e in estimates)


def _host_memory_line(plan: Plan, e: Estimate) -> str:
    """The host memory offload holds at its peak, over its states (issue 22's measure)."""
    held = e.offloaded["host"] + e.peak["host_buffers"]
    note = f"{held / e.offloaded['host']:.2f}× the states there"
    if plan.offload.optimizer != "none" and plan.offload.grads == "cpu":
        note += "; offload.grads: device keeps two units' gradients there, not every one"
    return f"  {'  = host memory (peak)':<24}{human_bytes(held):>12}  ({note})"


def _in_memory_line(e: Estimate) -> str:
    """The host memory ``checkpoint.in_memory`` takes per rank: two snapshots of its state
    (the newest step's and the step before's, whose pages the next is written into), and over
    several machines two of the copy it keeps of another machine's rank."""
    two = 2 * e.snapshot_bytes
    return (
        f"  {'in-memory checkpoints':<24}{human_bytes(two):>12}  (checkpoint.in_memory, in "
        f"/dev/shm: two snapshots of the rank's state; {human_bytes(2 * two)} over several "
        "machines, with the copies of another machine's)"
    )


def _estimate_text(plan: Plan, e: Estimate) -> str:
    p = plan.precision
    grads = p.kept_gradient(plan.zero)  # e is the estimate of this plan
    lines = [
        f"{plan.source or 'plan'}: ZeRO stage {e.stage}, {e.world_size} ranks, "
        f"compute {p.param}, reduce {p.reduce}, master {p.master}, grads {grads}",
        *(mesh_lines(e.mesh) if e.mesh is not None else []),
        *e.notes,
        "",
        "memory per rank (predicted from the scheduled program):",
    ]
    lines += [
        f"  {name:<24}{human_bytes(get(e)):>12}"
        for name, get in ROWS
        if _shown(name, plan, [e], get)
    ]
    if e.offloaded["host"]:
        lines.append(_host_memory_line(plan, e))
    if plan.checkpoint.in_memory:
        lines.append(_in_memory_line(e))
    if plan.grad_accumulation == 1:
        leave = e.grads_copied_out
        lines.append(held_gradients_line(e.held_grads, e.psi, e.world_size, width=24, leave=leave))
    lines += ["", "communication per optimizer step, per rank:"]
    lines += [f"  {kind:<24}{human_bytes(n):>12}" for kind, n in sorted(e.comm.items())]
    if not e.comm:
        lines.append(f"  {'none':<24}{human_bytes(0):>12}{no_communication(e.world_size)}")
    if plan.recompute.enabled:
        lines += ["", describe_recompute(e.recompute)]
    if e.transfers:
        lines += ["", "offload traffic per optimizer step, per rank:"]
        lines += [f"  {kind:<24}{human_bytes(n):>12}" for kind, n in sorted(e.transfers.items())]
    if e.timing is not None and e.rates is not None:
        t = e.timing
        host = f"  {'host updates':<24}{human_seconds(t.host_s):>12}"
        deferred = plan.offload.defer_updates != "none"
        host += (
            "  (beside compute, offload.defer_updates: the step waits "
            f"{human_seconds(t.host_waited_s)} for them)"
            if deferred
            else "  (part of compute: the host holds the stream)"
        )
        host_line = [host] if t.host_s else []
        lines += [
            "",
            "time per optimizer step (the program simulated on a compute and a comm stream):",
            f"  {'step':<24}{human_seconds(t.step_s):>12}",
            f"  {'compute':<24}{human_seconds(t.compute_s):>12}",
            f"  {'communication':<24}{human_seconds(t.comm_s):>12}",
            f"  {'exposed communication':<24}{human_seconds(t.exposed_s):>12}"
            f"  ({100 * t.exposed_fraction:.0f}% of the step)",
            *(_copy_lines(t, plan.offload) if e.transfers else []),
            *host_line,
            f"  {'peak memory':<24}{human_bytes(e.peak['total']):>12}",
            *_fit_line(e),
            "",
            f"rates ({_sources(e.rates)}):",
            f"  {e.rates.describe()}",
            *_uncalibrated(e.rates),
        ]
    return "\n".join(lines)


def _fit_line(e: Estimate) -> list[str]:
    """A line saying the predicted peak does not fit the memory the cuda rates describe (an
    H100's, as `zerocc plan auto` takes it), where it does not; none on cpu (its memory is this
    machine's, which `zerocc train` checks before it starts)."""
    from zerocc.cli.plan import CUDA_MEMORY_GIB

    memory = int(CUDA_MEMORY_GIB * 2**30)
    if e.rates.device != "cuda" or e.peak["total"] <= memory:
        return []
    return [
        f"  does not fit: the peak is {e.peak['total'] / memory:.1f}x an H100's "
        f"{CUDA_MEMORY_GIB:g} GiB per rank (the cuda rates' GPU); `zerocc plan auto PLAN "
        f"--world-size {e.world_size} --device cuda` searches for a plan that fits"
    ]


def _copy_lines(t: Simulation, offload: OffloadConfig) -> list[str]:
    """The offload copies' time, how long the step waits for them and, when backward waits for
    gradients bounded in flight, the plan's field that trades that wait for device memory."""
    line = f"  {'offload copies':<24}{human_seconds(t.copy_s):>12}"
    line += f"  (the step waits {human_seconds(t.copy_waited_s)} for them)"
    backward = t.copy_waited.get((TO_HOST, "backward"), 0.0)
    bounded = offload.grads == "cpu" and offload.grads_in_flight is not None
    if not bounded or backward <= 0.05 * t.step_s:
        return [line]
    return [
        line,
        f"  {'':<38}backward waits {human_seconds(backward)} of it for gradients on their way to "
        f"the host (offload.grads_in_flight: {offload.grads_in_flight}; more, or null, waits "
        "less and holds more device memory)",
    ]


RATE_NAMES = ("compute", "memory", "overhead", "link", "latency", "overlap", "host link", "nvme",
              "host memory")  # of RATE_FIELDS  # fmt: skip


def _sources(rates: DeviceRates) -> str:
    """Where the rates came from, e.g. ``link from the plan; the rest: cuda defaults``."""
    names = dict(zip(RATE_FIELDS, RATE_NAMES, strict=True))
    by_source: dict[str, list[str]] = {}
    for rate, name in names.items():
        by_source.setdefault(rates.sources.get(rate, "default"), []).append(name)
    if len(by_source) == 1:
        (source,) = by_source
        return f"{rates.device} {'defaults' if source == 'default' else source}"
    parts = [f"{', '.join(v)} from the {k}" for k, v in by_source.items() if k != "default"]
    if "default" in by_source:
        parts.append(f"{', '.join(by_source['default'])}: {rates.device} defaults")
    return "; ".join(parts)


def _uncalibrated(rates: DeviceRates) -> list[str]:
    warning = rates.uncalibrated()
    return ["", f"warning: {warning}"] if warning else []


def _estimate_table(plan: Plan, estimates: list[Estimate]) -> str:
    kinds = sorted({k for e in estimates for k in e.comm})
    header = f"{'per rank':<26}" + "".join(f"{'stage ' + str(e.stage):>12}" for e in estimates)
    lines = [
        f"{plan.source or 'plan'}: {estimates[0].world_size} ranks, "
        f"compute {plan.precision.param}; memory predicted from each stage's program",
        "",
        header,
        "-" * len(header),
    ]
    for name, get in ROWS:
        if _shown(name, plan, estimates, get):
            row = "".join(f"{human_bytes(get(e)):>12}" for e in estimates)
            lines.append(f"{name:<26}{row}")
    for kind in kinds or ["communication"]:  # one rank: a row of 0B
        lines.append(
            f"{kind + ' / step':<26}"
            + "".join(f"{human_bytes(e.comm.get(kind, 0)):>12}" for e in estimates)
        )
    for kind in sorted({k for e in estimates for k in e.transfers}):
        lines.append(
            f"{kind + ' / step':<26}"
            + "".join(f"{human_bytes(e.transfers.get(kind, 0)):>12}" for e in estimates)
        )
    if all(e.timing is not None for e in estimates):
        for name, get in TIME_ROWS:
            lines.append(f"{name:<26}" + "".join(f"{human_seconds(get(e)):>12}" for e in estimates))
        lines.append(f"(time: simulated with {_sources(estimates[0].rates)})")
        lines += _uncalibrated(estimates[0].rates)
    return "\n".join(lines)


TIME_ROWS = (
    ("step time", lambda e: e.timing.step_s),
    ("exposed communication", lambda e: e.timing.exposed_s),
)
