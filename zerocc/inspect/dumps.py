"""Dumps: what the compiler built and what a real run did, as files to read and share.

Turned on by the plan's ``dumps.dir`` or ``ZEROCC_DUMP_DIR`` (``zerocc train --dump DIR`` sets
it). Rank 0 writes, into that folder:

- ``programs/<program>/NN-<pass>.py`` and ``.dot`` (``.svg`` with Graphviz installed): the
  program after each pass, when it is compiled;
- after the first step that runs the optimizer, which every rank runs op by op on the eager
  binding (whatever the plan's backend), timed:
  ``trace.json`` (Chrome/Perfetto trace events: a compute and a communication track per rank,
  and under each rank the same program as the cost model predicts it, "rank N (predicted)"),
  ``memory.png`` (live bytes over the program by category, predicted and measured, peaks
  marked), and ``report.html``, which ties the plan, the passes, the units, the memory plot,
  the estimate and the trace together;
- under a backend that compiles (Inductor), whose code that op-by-op run is not, the next
  step that runs the optimizer as it runs: ``backend/trace.json`` (``torch.profiler``'s trace
  of rank 0's step) and its tensor memory from the allocator, a section of ``report.html``.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan import Plan
from zerocc.cost.memory import model_state_bytes_of, predict_memory
from zerocc.cost.rates import DeviceRates, rates_for
from zerocc.cost.simulate import Simulation, predict_step
from zerocc.cost.timeline import MemoryTimeline, TraceEvent, exposed_us
from zerocc.errors import PlanError
from zerocc.inspect.chrome_trace import chrome_trace
from zerocc.inspect.dot import GRAPHVIZ_HINT, program_to_dot, render_svg
from zerocc.inspect.estimate import pass_table
from zerocc.inspect.explain import comm_bytes_per_step, precision_line, unit_rows
from zerocc.inspect.report import ReportSection, write_report
from zerocc.ir.quantities import human_bytes

if TYPE_CHECKING:
    from zerocc.engine.comm import Comm
    from zerocc.runtime.measure import ProfiledRun
    from zerocc.runtime.record import StepRecord

DUMP_DIR_ENV = "ZEROCC_DUMP_DIR"
PERFETTO = "https://ui.perfetto.dev"


def dump_dir(plan: Plan) -> Path | None:
    """Where to dump: ``ZEROCC_DUMP_DIR``, else the plan's ``dumps.dir``, else nowhere."""
    where = os.environ.get(DUMP_DIR_ENV) or plan.dumps.dir
    return Path(where) if where else None


def dump_dir_named(plan: Plan) -> str:
    """How messages name the dump folder's setting: the variable when it is set, else the
    plan's field."""
    return DUMP_DIR_ENV if os.environ.get(DUMP_DIR_ENV) else "dumps.dir"


def check_dump_folder(root: Path, named: str) -> None:
    """PlanError unless dumps can be written under ``root`` (``named``: the setting that gave
    it, for the message): an existing folder that takes files, or one its nearest existing
    parent folder can hold. What every command checks before a rank starts (a rank failing
    to write its dumps fails after the step compiled, on rank 0 alone)."""
    existing = root
    try:
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise PlanError(f"{named}: {root}: {existing} is a file, not a folder")
        fd, probe = tempfile.mkstemp(prefix=".zerocc-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PlanError(
            f"{named}: {root}: dumps cannot be written there ({exc.strerror or exc}); name a "
            "folder this user can write"
        ) from None


def _made(folder: Path) -> Path:
    """``folder``, made with its parents; PlanError naming it when it cannot be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanError(
            f"dumps: cannot make the folder {folder} ({exc.strerror or exc}); set dumps.dir "
            f"or {DUMP_DIR_ENV} to a folder this user can write"
        ) from None
    return folder


def write_program_dumps(root: Path, name: str, records: list[PassRecord]) -> list[Path]:
    """The program after each pass as ``.py`` and ``.dot`` (and ``.svg`` when Graphviz is
    installed); returns the files written."""
    folder = _made(root / "programs" / name)
    written = []
    for i, record in enumerate(records):
        stem = folder / f"{i:02d}-{record.name}"
        stem.with_suffix(".py").write_text(record.program + "\n")
        written.append(stem.with_suffix(".py"))
        if record.gm is not None:
            dot = program_to_dot(record.gm, f"{name}: after {record.name}")
            stem.with_suffix(".dot").write_text(dot)
            written.append(stem.with_suffix(".dot"))
            if render_svg(dot, stem.with_suffix(".svg")):
                written.append(stem.with_suffix(".svg"))
    return written


@dataclass
class RunDumps:
    """What :func:`write_run_dumps` wrote on rank 0: the report and its sections, and the
    step's transient peak (beyond the model states), predicted and measured op by op, for the
    section :func:`write_compiled_dumps` adds."""

    report: Path
    sections: list[ReportSection]
    predicted_transient: int
    measured_transient: int


def write_run_dumps(
    root: Path, step: StepRecord, recorder: ProfiledRun, comm: Comm
) -> RunDumps | None:
    """Gather every rank's timed ops over ``comm`` (a collective: every rank calls it) and, on
    rank 0, write ``trace.json``, ``memory.png``, ``report.html`` and what the backend
    generated (``backend/``: Inductor's regions and their code); returns what it wrote on
    rank 0."""
    events = _gather(comm, recorder.events)
    if step.rank != 0:
        return None
    from zerocc.inspect.plots import plot_memory  # matplotlib: only when dumping

    _made(root)
    program = step.program
    states = model_state_bytes_of(step.layout)
    rates = rates_for(step.plan, step.device_type)
    simulated = predict_step({True: program}, 1, rates, step.world_size, mesh=step.mesh)
    ranks = sorted({e.rank for e in events})
    write_trace(events, simulated.events, ranks, root / "trace.json")
    predicted = predict_memory(program, states, gloo=step.on_gloo)
    plot_memory(
        root / "memory.png",
        predicted,
        recorder.timeline,
        f"rank 0, ZeRO stage {step.plan.zero.stage}, {step.world_size} ranks",
    )
    for name, text in step.backend_artifacts.items():  # what the backend generated
        (root / "backend").mkdir(exist_ok=True)
        (root / "backend" / name).write_text(text)
    report = root / "report.html"
    sections = _sections(root, step, predicted, recorder.timeline)
    sections.insert(0, _time_section(simulated, rates, recorder.events))
    write_report(report, title="zerocc run report", sections=sections)
    held = states["total"]  # on the device, throughout
    return RunDumps(
        report, sections, predicted.peak()[1] - held, recorder.timeline.peak()[1] - held
    )


def write_compiled_dumps(dumps: RunDumps, trace: Path, allocated: int, backend: str) -> None:
    """Add to the report what the step that ran ``backend``'s code allocated (``allocated``
    bytes beyond what was live before it, from the allocator) beside the transient peak
    predicted and measured op by op, and a link to its ``torch.profiler`` trace (``trace``)."""
    rows = [
        ["rank 0, beyond the model states", "peak tensor memory"],
        ["predicted (the scheduled program)", human_bytes(dumps.predicted_transient)],
        ["measured op by op (the eager binding)", human_bytes(dumps.measured_transient)],
        [f"measured as {backend}'s code ran (the allocator)", human_bytes(allocated)],
    ]
    section = ReportSection(
        f"Compiled step ({backend})",
        "table",
        rows,
        f"the step after the profiled one, as {backend}'s code runs it: its buffers live as "
        f"that code says, not as the program's values do. Its torch.profiler trace: "
        f"{os.path.relpath(trace, dumps.report.parent)} (open it in {PERFETTO}).",
    )
    dumps.sections.insert(-2, section)  # before the programs' list and the plan
    write_report(dumps.report, title="zerocc run report", sections=dumps.sections)


PREDICTED_PID = 1000  # trace process ids of the predicted ranks: PREDICTED_PID + rank


def write_trace(
    measured: list[TraceEvent], predicted: list[TraceEvent], ranks: list[int], path: Path
) -> None:
    """``trace.json``: each measured rank, and under it the predicted run of the same program
    as a process of its own, "rank N (predicted)" (every rank runs the same program)."""
    copies = [
        TraceEvent(PREDICTED_PID + rank, e.track, e.name, e.start_us, e.duration_us, e.args)
        for rank in ranks
        for e in predicted
    ]
    trace = chrome_trace(measured + copies)
    for event in trace["traceEvents"]:
        if event["ph"] != "M" or event.get("tid") is not None:
            continue
        predicted_rank = event["pid"] >= PREDICTED_PID
        rank = event["pid"] - PREDICTED_PID if predicted_rank else event["pid"]
        if event["name"] == "process_name":
            event["args"]["name"] = f"rank {rank} (predicted)" if predicted_rank else f"rank {rank}"
        elif event["name"] == "process_sort_index":
            event["args"]["sort_index"] = 2 * rank + predicted_rank
    path.write_text(json.dumps(trace, default=str))


def _time_section(simulated: Simulation, rates: DeviceRates, measured: list[TraceEvent]) -> (
        ReportSection):  # fmt: skip
    """Predicted against measured step and exposed communication, rank 0."""
    mine = [e for e in measured if e.rank == 0]
    span_us = max((e.start_us + e.duration_us for e in mine), default=0.0)
    exposed = exposed_us(mine)
    rows = [
        ["rank 0", "step", "compute", "communication", "exposed communication"],
        ["predicted", _ms(simulated.step_s * 1e6), _ms(simulated.compute_s * 1e6),
         _ms(simulated.comm_s * 1e6),
         f"{_ms(simulated.exposed_s * 1e6)} ({100 * simulated.exposed_fraction:.0f}%)"],
        ["measured (this profiled step)", _ms(span_us), _ms(_busy_us(mine, "compute")),
         _ms(_busy_us(mine, "comm")),
         f"{_ms(exposed)} ({100 * exposed / span_us if span_us else 0:.0f}%)"],
    ]  # fmt: skip
    parts = {
        "compute": (simulated.compute_s, _busy_us(mine, "compute") / 1e6),
        "communication": (simulated.comm_s, _busy_us(mine, "comm") / 1e6),
    }
    return ReportSection(
        "Time",
        "table",
        rows,
        why_they_differ(simulated.step_s, span_us / 1e6, parts, rates) + " "
        "Predicted: the program simulated by the cost model (rates: "
        f"{rates.describe()}; `zerocc profile` fits them to this machine). "
        "Measured: this run's step, op by op under the profiler, which adds its own overhead "
        "between ops; communication is the comm track's busy time, from each collective's "
        "issue to the end of its wait.",
    )


def why_they_differ(
    predicted_s: float,
    measured_s: float,
    parts: dict[str, tuple[float, float]],
    rates: DeviceRates,
) -> str:
    """A sentence on predicted against measured step time: that they agree (within 25%), or
    by how much they differ, which part (``parts``: name -> (predicted, measured) seconds)
    holds most of the gap, and what makes predictions miss here."""
    if predicted_s <= 0 or measured_s <= 0:
        return "Nothing to compare: a step of no time."
    ratio = measured_s / predicted_s
    if 0.8 <= ratio <= 1.25:
        return f"Predicted and measured agree within 25% ({ratio:.2f}×)."
    name, (p, m) = max(parts.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]))
    way = "longer" if ratio > 1 else "shorter"
    causes = []
    if rates.uncalibrated():
        causes.append(
            f"the rates are built-in {rates.device} defaults, not this machine's "
            "(`zerocc profile PLAN` measures them)"
        )
    if ratio > 1:
        causes.append("the profiler's own overhead on every op of the measured step")
    if name == "communication":
        causes.append("the link's rate and latency, which the rates give for an idle network")
    return (
        f"The measured step took {ratio:.1f}× {way} than predicted; most of the gap is "
        f"{name} ({_ms(m * 1e6)} measured, {_ms(p * 1e6)} predicted). Likely: "
        + "; ".join(causes or ["a part of the step the cost model does not see"])
        + "."
    )


def _busy_us(events: list[TraceEvent], track: str) -> float:
    """Microseconds covered by the track's events (overlapping events counted once)."""
    spans = sorted((e.start_us, e.start_us + e.duration_us) for e in events
                   if e.track == track and not e.args.get("exposed"))  # fmt: skip
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _ms(us: float) -> str:
    return f"{us / 1e3:.1f} ms"


def _gather(comm: Comm, events: list[Any]) -> list[Any]:
    return [e for rank_events in comm.all_gather_object(events) for e in rank_events]


# What the collectives on each kind of group carry, for the report's mesh table.
_CARRIES = {
    "dp": "ZeRO: gathers of unit shards, gradient reduce-scatters, the global checks",
    "replicate": "hybrid sharding: gradient shards all-reduced across replicas",
    "tp": "tensor parallelism: the split layers' activations and gradients",
    "pp": "pipeline parallelism: activations forward, their gradients back; the loss, the "
    "global checks",
    "tie": "a pipeline's first and last ranks: the gradient of a tied embedding and head",
}


def mesh_section(mesh: Mesh) -> list[ReportSection]:
    """The ranks' layout, one row per kind of group (none unless the ranks are split)."""
    if not mesh.split:
        return []
    rows = [["group", "ranks each", "groups", "first ones", "carries"]]
    for name in mesh.named_groups():
        groups = mesh.groups(name)
        shown = ", ".join(str(g) for g in groups[:2]) + (", …" if len(groups) > 2 else "")
        rows.append([name, str(len(groups[0])), str(len(groups)), shown, _CARRIES[name]])
    return [ReportSection("Mesh", "table", rows, mesh.describe())]


def _sections(
    root: Path, step: StepRecord, predicted: MemoryTimeline, measured: MemoryTimeline
) -> list[ReportSection]:
    plan = step.plan
    records = step.records
    units = unit_rows(step.units)
    plan_text = yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False)
    # What a person asks first (time, once inserted; memory; communication), the plan last.
    sections = [
        ReportSection(
            "Memory",
            "image",
            str(root / "memory.png"),
            _memory_caption(predicted, measured),
        ),
        ReportSection("Estimate", "text", _estimate_text(step, predicted)),
        ReportSection(
            "Timeline",
            "link",
            str(root / "trace.json"),
            f"the measured schedule, a compute and a communication track per rank, each "
            f"followed by the schedule the cost model predicts (rank N (predicted)): open it in "
            f"{PERFETTO} (Open trace file) or chrome://tracing",
        ),
        ReportSection(
            "Passes",
            "table",
            pass_table(records),
            "what each pass did to the program that runs the optimizer (zerocc inspect)",
        ),
        *mesh_section(step.mesh),
        ReportSection("Units", "table", units, precision_line(step)),
        programs_section(root),
        ReportSection("Plan", "text", f"# {plan.source or 'plan'}\n{plan_text}"),
    ]
    return sections


def _memory_caption(predicted: MemoryTimeline, measured: MemoryTimeline) -> str:
    (_, p), (_, m) = predicted.peak(), measured.peak()
    gloo = (
        " gloo's own buffers (comm) are predicted only: the run measures the program's tensors."
        if any(predicted.series["comm"])
        else ""
    )
    return (
        f"live bytes of rank 0 over the program, by category: predicted from the scheduled "
        f"program (areas), measured in this run (line). Peak: predicted {human_bytes(p)}, "
        f"measured {human_bytes(m)}.{gloo}"
    )


def _estimate_text(step: StepRecord, predicted: MemoryTimeline) -> str:
    states = model_state_bytes_of(step.layout)
    lines = ["model states per rank:"]
    lines += [f"  {k:<14}{human_bytes(v):>12}" for k, v in states.items()]
    lines += [
        f"  {'gathered peak':<14}{human_bytes(max(predicted.series['gathered'])):>12}",
        f"  {'activ. peak':<14}{human_bytes(max(predicted.series['activations'])):>12}",
    ]
    if gloo := max(predicted.series["comm"], default=0):  # (ranks on gloo only)
        lines.append(f"  {'gloo peak':<14}{human_bytes(gloo):>12}")
    lines += [
        f"  {'peak':<14}{human_bytes(predicted.peak()[1]):>12}",
        "communication per optimizer step, per rank:",
    ]
    lines += [f"  {k:<14}{human_bytes(v):>12}" for k, v in comm_bytes_per_step(step).items()]
    return "\n".join(lines)


def programs_section(root: Path) -> ReportSection:
    """The files :func:`write_program_dumps` wrote under ``root``."""
    programs = sorted((root / "programs").glob("*/*"))
    links = "".join(
        f'<li><a href="{html.escape(p.relative_to(root).as_posix())}">'
        f"{html.escape(str(p.relative_to(root)))}</a></li>"
        for p in programs
    )
    if any(p.suffix == ".svg" for p in programs):
        caption = "each program after each pass, as Python, Graphviz DOT and SVG"
    else:
        caption = f"each program after each pass, as Python and Graphviz DOT; {GRAPHVIZ_HINT}"
    return ReportSection("Programs", "html", f"<ul>{links}</ul>", caption)
