"""Dumps: what the compiler built and what a real run did, as files to read and share.

Turned on by the plan's ``dumps.dir`` or ``ZEROCC_DUMP_DIR`` (``zerocc train --dump DIR`` sets
it). Rank 0 writes, into that folder:

- ``programs/<program>/NN-<pass>.py`` and ``.dot`` (``.svg`` with Graphviz installed): the
  program after each pass, when it is compiled;
- after the first step that runs the optimizer, which every rank runs op by op, timed:
  ``trace.json`` (Chrome/Perfetto trace events: a compute and a communication track per rank),
  ``memory.png`` (live bytes over the program by category, predicted and measured, peaks
  marked), and ``report.html``, which ties the plan, the passes, the units, the memory plot,
  the estimate and the trace together.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import yaml

from zerocc.chrome_trace import write_chrome_trace
from zerocc.dot import GRAPHVIZ_HINT, program_to_dot, render_svg
from zerocc.explain import comm_bytes_per_step, precision_line, unit_rows
from zerocc.inspection import pass_table
from zerocc.memory import model_state_bytes_of, predict_memory
from zerocc.pass_manager import PassRecord
from zerocc.plan import Plan
from zerocc.printing import human_bytes
from zerocc.report import ReportSection, write_report
from zerocc.timeline import MemoryTimeline

if TYPE_CHECKING:
    from zerocc.comm import Comm
    from zerocc.measure import ProfiledRun
    from zerocc.train_step import TrainStep

DUMP_DIR_ENV = "ZEROCC_DUMP_DIR"
PERFETTO = "https://ui.perfetto.dev"


def dump_dir(plan: Plan) -> Path | None:
    """Where to dump: ``ZEROCC_DUMP_DIR``, else the plan's ``dumps.dir``, else nowhere."""
    where = os.environ.get(DUMP_DIR_ENV) or plan.dumps.dir
    return Path(where) if where else None


def write_program_dumps(root: Path, name: str, records: list[PassRecord]) -> list[Path]:
    """The program after each pass as ``.py`` and ``.dot`` (and ``.svg`` when Graphviz is
    installed); returns the files written."""
    folder = root / "programs" / name
    folder.mkdir(parents=True, exist_ok=True)
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


def write_run_dumps(root: Path, step: TrainStep, recorder: ProfiledRun) -> Path | None:
    """Gather every rank's timed ops (a collective: every rank calls it) and, on rank 0, write
    ``trace.json``, ``memory.png`` and ``report.html``; returns the report's path on rank 0."""
    events = _gather(step.comm, recorder.events)
    if step.comm.rank != 0:
        return None
    from zerocc.plots import plot_memory  # matplotlib: only when dumping

    root.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(events, root / "trace.json")
    program = step.program
    states = model_state_bytes_of(step.units, step.plan)
    predicted = predict_memory(program, states)
    plot_memory(
        root / "memory.png",
        predicted,
        recorder.timeline,
        f"rank 0, ZeRO stage {step.plan.zero.stage}, {step.comm.world_size} ranks",
    )
    report = root / "report.html"
    write_report(report, title="zerocc run report", sections=_sections(root, step, predicted,
                 recorder.timeline))  # fmt: skip
    return report


def _gather(comm: Comm, events: list[Any]) -> list[Any]:
    from zerocc.comm import TorchComm

    if not isinstance(comm, TorchComm) or comm.world_size == 1:
        return list(events)
    everyone: list[Any] = [None] * comm.world_size
    dist.all_gather_object(everyone, events, group=comm.group)
    return [e for rank_events in everyone for e in rank_events]


def _sections(
    root: Path, step: TrainStep, predicted: MemoryTimeline, measured: MemoryTimeline
) -> list[ReportSection]:
    plan = step.plan
    records = step.records
    units = unit_rows(step.units)
    plan_text = yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False)
    programs = sorted((root / "programs").glob("*/*"))
    graphs = [["file"]] + [[str(p.relative_to(root))] for p in programs]
    sections = [
        ReportSection("Plan", "text", f"# {plan.source or 'plan'}\n{plan_text}"),
        ReportSection(
            "Passes",
            "table",
            pass_table(records),
            "what each pass did to the program that runs the optimizer (zerocc inspect)",
        ),
        ReportSection("Units", "table", units, precision_line(step)),
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
            f"the measured schedule, a compute and a communication track per rank: open it in "
            f"{PERFETTO} (Open trace file) or chrome://tracing",
        ),
        ReportSection("Programs", "table", graphs, _graph_caption(programs)),
    ]
    return sections


def _memory_caption(predicted: MemoryTimeline, measured: MemoryTimeline) -> str:
    (_, p), (_, m) = predicted.peak(), measured.peak()
    return (
        f"live bytes of rank 0 over the program, by category: predicted from the scheduled "
        f"program (areas), measured in this run (line). Peak: predicted {human_bytes(p)}, "
        f"measured {human_bytes(m)}."
    )


def _estimate_text(step: TrainStep, predicted: MemoryTimeline) -> str:
    states = model_state_bytes_of(step.units, step.plan)
    lines = ["model states per rank:"]
    lines += [f"  {k:<14}{human_bytes(v):>12}" for k, v in states.items()]
    lines += [
        f"  {'gathered peak':<14}{human_bytes(max(predicted.series['gathered'])):>12}",
        f"  {'activ. peak':<14}{human_bytes(max(predicted.series['activations'])):>12}",
        f"  {'peak':<14}{human_bytes(predicted.peak()[1]):>12}",
        "communication per optimizer step, per rank:",
    ]
    lines += [f"  {k:<14}{human_bytes(v):>12}" for k, v in comm_bytes_per_step(step).items()]
    return "\n".join(lines)


def _graph_caption(programs: list[Path]) -> str:
    if any(p.suffix == ".svg" for p in programs):
        return "the program after each pass, as Python, Graphviz DOT and SVG"
    return f"the program after each pass, as Python and Graphviz DOT; {GRAPHVIZ_HINT}"
