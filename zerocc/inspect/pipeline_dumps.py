"""Dumps of a pipeline step (``parallel.pp`` > 1, issue 47): each pipeline rank's programs after
each pass, and what every rank did in a step beside what the cost model predicts, its bubbles
drawn.

Turned on as a TrainStep's dumps are (``dumps.dir``, ``ZEROCC_DUMP_DIR``, ``zerocc train
--dump DIR``). Into that folder:

- ``programs/rank<p>-stage<s>-<F|B|I|W>/NN-<pass>.py`` (``.dot``, and ``.svg`` with Graphviz)
  and ``programs/rank<p>-update/``: pipeline rank ``p``'s programs after each pass, written
  when they are compiled by the first rank that holds its stages (so the folder must be one
  every rank writes to: one machine, or a shared file system);
- after the first step, and again after the second (a warm one, where the run has it), on
  rank 0: ``trace.json`` (Chrome/Perfetto trace events) with every rank's actions as it ran
  them (a stage's forward, backward or backward half of one micro-batch, then the update),
  each receive that waited for a neighbour drawn inside its action as a ``bubble`` slice
  naming the stage it waited for, and under them each pipeline rank's schedule as the cost
  model predicts it ("pipeline rank N (predicted)"), its idle time as ``bubble`` slices; and
  ``report.html``: the plan, the mesh, the cut and the schedule, each rank's measured and
  predicted bubble, the trace and the programs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.pipeline_schedule import PipelineSchedule, Timeline
from zerocc.compiler.plan import Plan
from zerocc.cost.model import CostModel
from zerocc.cost.rates import DeviceRates, rates_for
from zerocc.cost.timeline import TraceEvent
from zerocc.inspect.chrome_trace import chrome_trace
from zerocc.inspect.dumps import (
    PERFETTO,
    PREDICTED_PID,
    mesh_section,
    programs_section,
    write_program_dumps,
)
from zerocc.inspect.pipeline_estimate import action_seconds, program_seconds
from zerocc.inspect.report import ReportSection, write_report
from zerocc.ir.quantities import human_seconds
from zerocc.runtime.pipeline import StepTimeline

if TYPE_CHECKING:
    from zerocc.engine.comm import Comm

TRACK = "compute"  # a rank's actions, and the bubbles inside them
KINDS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


@dataclass(frozen=True)
class RankStep:
    """One rank's step as the dumps draw it: what it did, and its programs' predicted
    seconds (by ``(stage, kind)``, and the update's), gathered from every rank."""

    rank: int
    pp_rank: int
    stages: list[int]
    timeline: StepTimeline
    predicted: dict[tuple[int, str], float]
    predicted_update: float


def write_pipeline_programs(root: Path, records: dict[str, list[PassRecord]]) -> None:
    """Each of a pipeline rank's programs after each pass (see the module's doc)."""
    for name, program_records in records.items():
        write_program_dumps(root, name, program_records)


def write_step_run(step: Any) -> None:
    """The last step of every rank of pipeline ``step`` (a built pipeline rank's step) drawn
    beside the predicted one (a collective: see :func:`write_pipeline_run`); its programs'
    predicted seconds are worked out once and kept in ``step.pipeline.predicted_seconds``."""
    walk = step.pipeline  # (its rank's walk: zerocc.runtime.pipeline_rank.PipelineWalk)
    rates = rates_for(step.plan, step.device.type)
    if walk.predicted_seconds is None:
        cost = CostModel(rates, step.comm.world_size, step.mesh)
        seconds = {key: program_seconds(p.gm, cost) if p is not None else 0.0
                   for key, p in walk.programs.items()}  # fmt: skip
        walk.predicted_seconds = seconds, program_seconds(walk.update.gm, cost)
    mine = RankStep(step.comm.rank, walk.pp_rank, walk.schedule.stages_of(walk.pp_rank),
                    walk.timeline, *walk.predicted_seconds)  # fmt: skip
    write_pipeline_run(
        step.dump_dir, step.comm, mine, step.micro_batches, plan=step.plan, mesh=step.mesh,
        schedule=walk.schedule, rates=rates,
        explain=step.explain() if step.comm.rank == 0 else "",
    )  # fmt: skip


def write_pipeline_run(
    root: Path,
    comm: Comm,
    mine: RankStep,
    step: int,
    *,
    plan: Plan,
    mesh: Mesh,
    schedule: PipelineSchedule,
    rates: DeviceRates,
    explain: str,
) -> Path | None:
    """Gather every rank's ``mine`` over ``comm`` (a collective: every rank calls it) and, on
    rank 0, write ``trace.json`` and ``report.html`` of step ``step``; returns the report's
    path on rank 0."""
    ranks: list[RankStep] = sorted(comm.all_gather_object(mine), key=lambda r: r.rank)
    if comm.rank != 0:
        return None
    root.mkdir(parents=True, exist_ok=True)
    times = {key: s for r in ranks for key, s in r.predicted.items()}
    predicted = schedule.simulate(action_seconds(times))
    updates = {r.pp_rank: r.predicted_update for r in ranks}
    events = _measured(ranks) + _predicted(predicted, updates)
    names = {r.rank: (f"rank {r.rank} (pipeline rank {r.pp_rank}, stages {r.stages})", r.rank)
             for r in ranks}  # fmt: skip
    for p in range(mesh.pp):
        names[PREDICTED_PID + p] = (f"pipeline rank {p} (predicted)", PREDICTED_PID + p)
    (root / "trace.json").write_text(json.dumps(_named(chrome_trace(events), names)))
    report = root / "report.html"
    step_s = predicted.makespan + max(updates.values())
    sections = [
        *mesh_section(mesh),
        ReportSection("Pipeline", "text", explain, "rank 0's explain(): the cut, its schedule"),
        ReportSection(
            "Bubbles",
            "table",
            _bubble_rows(ranks, predicted, step_s),
            f"step {step} as each rank ran it (its wait: the share of its actions' span spent "
            "receiving a neighbour's tensor) and as the cost model predicts it (rates: "
            f"{rates.describe()}{'; ' + rates.uncalibrated() if rates.uncalibrated() else ''})",
        ),
        ReportSection(
            "Timeline",
            "link",
            str(root / "trace.json"),
            f"step {step}: every rank's actions, each wait for a neighbour inside them as a "
            "bubble slice, then each pipeline rank's schedule as predicted, idle time as "
            f"bubble slices: open it in {PERFETTO} (Open trace file) or chrome://tracing",
        ),
        programs_section(root),
        ReportSection(
            "Plan",
            "text",
            f"# {plan.source or 'plan'}\n"
            + yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False),
        ),  # fmt: skip
    ]
    write_report(report, title="zerocc pipeline run report", sections=sections)
    return report


def _us(seconds: float) -> float:
    return seconds * 1e6


def _action_event(pid: int, action, start: float, end: float, **args) -> TraceEvent:
    name = f"{action.kind}{action.microbatch} stage {action.stage}"
    where = {"stage": action.stage, "microbatch": action.microbatch, "kind": KINDS[action.kind]}
    return TraceEvent(pid, TRACK, name, _us(start), _us(end - start), {**where, **args})


def _measured(ranks: list[RankStep]) -> list[TraceEvent]:
    """Every rank's actions, receives and update, on one clock (the earliest rank's start)."""
    origin = min(r.timeline.started for r in ranks)
    events = []
    for r in ranks:
        t, shift = r.timeline, r.timeline.started - origin
        for action, start, end, waited in t.actions:
            events.append(_action_event(r.rank, action, shift + start, shift + end,
                                        waited_ms=waited * 1e3))  # fmt: skip
        for start, end, stage in t.receives:
            name = f"bubble: waiting for stage {stage}"
            events.append(TraceEvent(r.rank, TRACK, name, _us(shift + start), _us(end - start)))
        start, end = t.update
        events.append(TraceEvent(r.rank, TRACK, "update", _us(shift + start), _us(end - start)))
    return events


def _predicted(timeline: Timeline, updates: dict[int, float]) -> list[TraceEvent]:
    """Each pipeline rank's schedule as simulated, its idle time as bubble slices, then its
    update."""
    events = []
    for p, spans in enumerate(timeline.spans):
        pid, free = PREDICTED_PID + p, 0.0
        for action, start, end in (*spans, (None, timeline.makespan, timeline.makespan)):
            if start > free:
                events.append(TraceEvent(pid, TRACK, "bubble", _us(free), _us(start - free)))
            if action is not None:
                events.append(_action_event(pid, action, start, end))
            free = end
        update = updates.get(p, 0.0)
        events.append(TraceEvent(pid, TRACK, "update", _us(timeline.makespan), _us(update)))
    return events


def _named(trace: dict, names: dict[int, tuple[str, int]]) -> dict:
    """The trace with each process named and sorted as ``names`` says (pid -> name, order)."""
    for event in trace["traceEvents"]:
        if event["ph"] != "M" or event.get("tid") is not None or event["pid"] not in names:
            continue
        name, order = names[event["pid"]]
        if event["name"] == "process_name":
            event["args"]["name"] = name
        elif event["name"] == "process_sort_index":
            event["args"]["sort_index"] = order
    return trace


def _bubble_rows(ranks: list[RankStep], predicted: Timeline, step_s: float) -> list[list[str]]:
    rows = [["rank", "pipeline rank", "stages", "step, measured", "waited, measured",
             "step, predicted", "idle, predicted"]]  # fmt: skip
    for r in ranks:
        spans = predicted.spans[r.pp_rank]
        busy = sum(end - start for _, start, end in spans)
        idle = 1 - busy / predicted.makespan if predicted.makespan > 0 else 0.0
        rows.append([
            str(r.rank), str(r.pp_rank), str(r.stages), human_seconds(r.timeline.update[1]),
            f"{r.timeline.waiting_share:.1%}", human_seconds(step_s), f"{idle:.1%}",
        ])  # fmt: skip
    return rows
