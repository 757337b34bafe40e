"""What a pipeline rank reports of its step (a ``zerocc.TrainStep``'s ``summary()``,
``explain()``, ``backend_notes()`` under ``parallel.pp`` > 1): the cut, the schedule and its
measured waiting, the bytes sent to neighbours, the predicted memory, and what the backend made
of each program. The rank's walk is :mod:`zerocc.runtime.pipeline_rank`; its dumps,
:mod:`.pipeline_dumps`."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from zerocc.backends import resolve_backend
from zerocc.compiler.driver.pipeline import program_name
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.pipeline_schedule import PipelineSchedule
from zerocc.compiler.parallel.router_loss import router_loss_lines
from zerocc.compiler.parallel.stage_programs import StagedStep
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.pipeline import describe_zero
from zerocc.compiler.state import StateLayout
from zerocc.cost.memory import model_state_bytes_of
from zerocc.cost.pipeline_memory import PipelineMemory
from zerocc.engine.comm import Comm
from zerocc.runtime.pipeline import StepTimeline


class PipelineWalkView(Protocol):
    """What the report reads of a pipeline rank's walk once built
    (:class:`~zerocc.runtime.pipeline_rank.PipelineWalk`)."""

    schedule: PipelineSchedule
    staged: StagedStep
    pp_rank: int
    microbatches: int
    timeline: StepTimeline
    programs: dict[tuple[int, str], Any]
    update: Any
    predicted_memory: PipelineMemory

    def rank_of(self, stage: int) -> int: ...


class PipelineRankView(Protocol):
    """What the report reads of a built pipeline rank (a ``TrainStep`` under ``parallel.pp``
    > 1 after its first call): the step's own, and its walk's (``pipeline``)."""

    plan: Plan
    mesh: Mesh
    comm: Comm
    device: torch.device
    pipeline: PipelineWalkView
    micro_batches: int
    steps: int

    @property
    def data_rank(self) -> int: ...
    @property
    def data_parallel(self) -> int: ...
    @property
    def loss_scale(self) -> float | None: ...
    @property
    def layout(self) -> StateLayout: ...


def sent_bytes(step: PipelineRankView) -> int:
    """Bytes the rank sends to other pipeline ranks per step: activations forward, gradients
    back, for each micro-batch (what goes to a stage of its own is handed over in memory)."""
    walk = step.pipeline
    sent = [
        slot
        for s in walk.schedule.stages_of(walk.pp_rank)
        for program in (walk.staged.stages[s].forward, walk.staged.stages[s].backward)
        for slot in program.outputs
        if slot.kind == "send" and walk.rank_of(slot.peer) != walk.pp_rank
    ]
    return walk.microbatches * sum(math.prod(o.shape) * o.dtype.itemsize for o in sent)


def summary(step: PipelineRankView) -> dict[str, Any]:
    """Figures of the last step, as a TrainStep's summary gives them, the bytes sent to
    neighbours counted as ``send``; and the pipeline's own: the share of the step the rank
    waited for a neighbour, and its predicted peak."""
    comm = dict(step.comm.stats.bytes)
    if sent := sent_bytes(step):
        comm["send"] = sent
    return {
        "comm_bytes_per_step": comm,
        "model_state_bytes": model_state_bytes_of(step.layout)["total"],
        "offload_bytes_per_step": {},
        "loss_scale": step.loss_scale,
        "skipped_steps": step.micro_batches - step.steps,
        "pipeline_waiting_share": step.pipeline.timeline.waiting_share,
        "predicted_peak_bytes": step.pipeline.predicted_memory.peak,
    }


def explain(step: PipelineRankView) -> str:
    """What the rank runs: the cut, its schedule with the predicted bubble, the last step's
    measured waiting, its predicted memory, and what the backend made of its programs."""
    walk = step.pipeline
    pipeline = step.plan.pipeline
    lines = [
        f"pipeline rank {walk.pp_rank} of {step.mesh.pp} (stages "
        f"{walk.schedule.stages_of(walk.pp_rank)} of {walk.schedule.stages}), data rank "
        f"{step.data_rank} of {step.data_parallel}; schedule {pipeline.schedule}, "
        f"{walk.microbatches} micro-batches per step",
        step.mesh.describe(),
        describe_zero(step.plan.zero.stage, pipeline.gather),
        *router_loss_lines(
            [s.forward.gm for s in walk.staged.stages],
            walk.microbatches,
            step.data_parallel,
            pipeline=True,
        ),
        "",
        "what each stage holds and what crosses each cut",
        walk.staged.format(),
        "",
        "schedule",
        walk.schedule.format(),
        f"measured (the last step, step {step.micro_batches}): this rank waited "
        f"{walk.timeline.waiting_share:.1%} of it for a neighbour",
        "",
        f"memory of this rank: {walk.predicted_memory.format()}",
        *_backend_lines(step),
    ]
    return "\n".join(lines)


def backend_notes(step: PipelineRankView) -> dict[str, list[str]]:
    """What the backend made of each of the rank's programs, by program name (``rank0-
    stage1-F``, ``rank0-update``): compiled whole or by region, and why (the eager backend
    says nothing)."""
    walk = step.pipeline
    programs = {program_name(walk.pp_rank, key): p for key, p in walk.programs.items()}
    programs[program_name(walk.pp_rank, None)] = walk.update
    return {name: p.run.notes() for name, p in programs.items() if p is not None}


def _backend_lines(step: PipelineRankView) -> list[str]:
    said = [f"  {name}: {note}" for name, notes in backend_notes(step).items() for note in notes]
    backend = resolve_backend(step.plan.backend.name, step.device)
    return ["", f"backend {backend}:", *said] if said else []
