"""``zerocc estimate`` of a pipeline plan (``parallel.pp`` > 1): each pipeline rank's programs
compiled for the world size as its :class:`zerocc.PipelineStep` would compile them, its memory
walked over its schedule, and the step's time: each action's program simulated by the cost
model, then the schedule simulated with those times (its bubble is what the ranks wait).

The other schedules over the same stages (the same ``stages_per_rank``) are simulated with the
same times, so the plan's choice can be weighed: where the plan compiles a whole backward and a
schedule splits it (zero-bubble), each half is counted as half of it, and the other way round
the halves add up. Sends between pipeline ranks are not timed (an activation per micro-batch:
small beside the stages' compute at the sizes pipelines are for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerocc.compiler.driver.pipeline import compile_rank
from zerocc.compiler.parallel.pipeline_schedule import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    Timeline,
    pipeline_schedule,
)
from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import Workload
from zerocc.cost.memory import model_state_bytes_of
from zerocc.cost.model import CostModel, DeviceRates, rates_for
from zerocc.cost.pipeline_memory import PipelineMemory, predict_pipeline_memory
from zerocc.cost.simulate import simulate
from zerocc.errors import PlanError
from zerocc.inspect.pipeline import PipelineInspection, inspect_pipeline
from zerocc.ir.printing import human_bytes


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank: its stages, model states, predicted memory and each program's time."""

    pp_rank: int
    stages: list[int]
    model_states: dict[str, int]
    memory: PipelineMemory
    seconds: dict[tuple[int, str], float]  # (stage, kind) -> one micro-batch's program
    update_s: float


@dataclass
class PipelineEstimate:
    """A pipeline plan's per-rank memory and the step's time, for ``world_size`` ranks."""

    inspection: PipelineInspection
    ranks: list[RankEstimate]
    timeline: Timeline  # the plan's schedule, simulated with the predicted times
    bubbles: dict[str, float | str]  # schedule -> bubble over the same stages (or why none)
    rates: DeviceRates

    @property
    def step_s(self) -> float:
        """The step: the schedule's makespan, then the slowest rank's update."""
        return self.timeline.makespan + max(r.update_s for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain data (``zerocc estimate --json``)."""
        return {
            "world_size": self.inspection.mesh.world_size,
            "schedule": self.inspection.schedule.name,
            "microbatches": self.inspection.schedule.microbatches,
            "step_s": self.step_s,
            "bubble": self.timeline.bubble,
            "bubble_by_schedule": self.bubbles,
            "ranks": [
                {
                    "pp_rank": r.pp_rank,
                    "stages": r.stages,
                    "model_states": r.model_states,
                    "peak_bytes": r.memory.peak,
                    "kept_bytes": r.memory.kept,
                    "microbatches_in_flight": r.memory.in_flight,
                    "update_s": r.update_s,
                }
                for r in self.ranks
            ],
            "rates": self.rates.as_dict(),
        }

    def format(self) -> str:
        inspection, schedule = self.inspection, self.inspection.schedule
        plan = inspection.plan
        lines = [
            f"{plan.source or 'plan'}: pipeline of {schedule.stages} stages on "
            f"{inspection.mesh.pp} pipeline ranks, schedule {schedule.name}, "
            f"{schedule.microbatches} micro-batches per step; ZeRO stage {plan.zero.stage} "
            f"inside each stage, compute {plan.precision.param}",
            inspection.mesh.describe(),
            "",
            "per pipeline rank (each of its data- and tensor-parallel ranks alike):",
        ]
        for r in self.ranks:
            forward = sum(s for (_, kind), s in r.seconds.items() if kind == "F")
            backward = sum(s for (_, kind), s in r.seconds.items() if kind != "F")
            lines.append(
                f"  rank {r.pp_rank} (stages {r.stages}): model states "
                f"{human_bytes(r.model_states['total'])}, peak {human_bytes(r.memory.peak)} "
                f"(kept for backward {human_bytes(r.memory.kept)}, {r.memory.in_flight} "
                f"micro-batch(es) in flight); per micro-batch forward {_ms(forward)}, "
                f"backward {_ms(backward)}; update {_ms(r.update_s)}"
            )
        lines += [
            "",
            f"time per step: {_ms(self.step_s)} (the schedule {_ms(self.timeline.makespan)}, "
            f"then the slowest update); bubble {self.timeline.bubble:.1%} (the ranks' time "
            "spent waiting for a neighbour)",
            "bubble of each schedule over these stages, with the same predicted times:",
        ]
        for name, bubble in self.bubbles.items():
            shown = f"{bubble:.1%}" if isinstance(bubble, float) else bubble
            lines.append(f"  {name:<18}{shown}")
        lines += ["", f"rates: {self.rates.describe()}"]
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def estimate_pipeline(
    plan: Plan, world_size: int, workload: Workload | None = None, rates: DeviceRates | None = None
) -> PipelineEstimate:
    """Compile every pipeline rank of ``plan`` for ``world_size`` ranks (fake tensors: a meta
    model of any size) and predict its memory and the step's time."""
    inspection = inspect_pipeline(plan, world_size, workload)
    rates = rates or rates_for(inspection.plan)
    cost = CostModel(rates, world_size, inspection.mesh)
    schedule, work = inspection.schedule, inspection.workload

    def seconds(gm) -> float:
        return simulate(gm, cost, issue_s=cost.issue_s, stolen=cost.stolen).step_s

    ranks = []
    for r in range(inspection.mesh.pp):
        compiled = compile_rank(
            work.model, inspection.plan, world_size, work.loss_fn, inspection.full,
            inspection.tensor_parallel, inspection.staged, schedule, r, torch.device("cpu"),
        )  # fmt: skip
        states = model_state_bytes_of(compiled.session.layout)
        memory = predict_pipeline_memory(schedule.actions[r], compiled.programs, states["total"])
        times = {k: seconds(gm) if gm is not None else 0.0 for k, gm in compiled.programs.items()}
        ranks.append(
            RankEstimate(r, schedule.stages_of(r), states, memory, times, seconds(compiled.update))
        )
    times = {key: s for rank in ranks for key, s in rank.seconds.items()}
    timeline = schedule.simulate(_action_seconds(times))
    return PipelineEstimate(inspection, ranks, timeline, _bubbles(schedule, times), rates)


def _action_seconds(times: dict[tuple[int, str], float]) -> Callable[[Action], float]:
    """Each action's time from the programs': a whole backward as its halves' sum, a half as
    half the whole backward, when the schedule runs backward otherwise than compiled."""

    def of(action: Action) -> float:
        key = (action.stage, action.kind)
        if key in times:
            return times[key]
        if action.kind == "B":
            return times[action.stage, "I"] + times[action.stage, "W"]
        return times[action.stage, "B"] / 2

    return of


def _bubbles(
    planned: PipelineSchedule, times: dict[tuple[int, str], float]
) -> dict[str, float | str]:
    """Each schedule's bubble over the plan's stages (those of its ``stages_per_rank``), or
    why it cannot run them."""
    bubbles: dict[str, float | str] = {}
    for name in SCHEDULES:
        try:
            schedule = pipeline_schedule(
                name, planned.pp, planned.microbatches, planned.stages_per_rank
            )
        except PlanError as error:
            bubbles[name] = f"(not over these stages: {str(error).split(';')[0]})"
            continue
        bubbles[name] = schedule.simulate(_action_seconds(times)).bubble
    return bubbles
