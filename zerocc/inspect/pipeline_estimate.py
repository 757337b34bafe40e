"""``zerocc estimate`` of a pipeline plan (``parallel.pp`` > 1): each pipeline rank's programs
compiled for the world size as its step would compile them
(:mod:`zerocc.runtime.pipeline_rank`), its memory walked over its schedule, and the step's
time: each action's program simulated by the cost model, then the schedule simulated with those
times (its bubble is what the ranks wait).

The other schedules over the same stages (the same ``stages_per_rank``) are simulated with the
same times, so the plan's choice can be weighed: where the plan compiles a whole backward and a
schedule splits it (zero-bubble), each half is counted as half of it, and the other way round
the halves add up. What a stage program sends to the next stage (activations forward, their
gradients backward) delays that stage's action by the send's time on the ``pp`` link
(:meth:`~zerocc.cost.model.CostModel.send_time`); a tensor sent past a neighbour (a skip
connection over a stage) travels while the stage between runs, and is not timed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from zerocc.compiler.driver.pipeline import RankPrograms, compile_rank
from zerocc.compiler.driver.program import CapturedSteps
from zerocc.compiler.parallel.pipeline_schedule import (
    Action,
    Dependency,
    PipelineSchedule,
    Timeline,
    schedules_over,
)
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.pipeline import describe_zero
from zerocc.compiler.workload import Workload
from zerocc.cost.memory import model_state_bytes_of, tensors_in
from zerocc.cost.model import CostModel
from zerocc.cost.pipeline_memory import PipelineMemory, predict_pipeline_memory
from zerocc.cost.rates import DeviceRates, rates_for
from zerocc.cost.simulate import simulate
from zerocc.inspect.explain import comm_bytes
from zerocc.inspect.pipeline import PipelineInspection, inspect_pipeline
from zerocc.ir.nodes import op_name, val
from zerocc.ir.quantities import human_bytes, human_seconds


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank: its stages, model states, predicted memory and each program's time."""

    pp_rank: int
    stages: list[int]
    model_states: dict[str, int]
    memory: PipelineMemory
    seconds: dict[tuple[int, str], float]  # (stage, kind) -> one micro-batch's program
    update_s: float
    collective_bytes: dict[str, int]  # collective kind -> bytes per step (explain's kinds)
    sent: dict[tuple[int, str], dict[int, int]]  # (stage, kind) -> stage sent to -> bytes


@dataclass
class PipelineEstimate:
    """A pipeline plan's per-rank memory and the step's time, for ``world_size`` ranks."""

    inspection: PipelineInspection
    ranks: list[RankEstimate]
    timeline: Timeline  # the plan's schedule, simulated with the predicted times
    bubbles: dict[str, float | str]  # schedule -> bubble over the same stages (or why none)
    # schedule -> the highest rank's peak (those that run backward as the plan compiles it)
    peaks: dict[str, int]
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
            "peak_bytes_by_schedule": self.peaks,
            "ranks": [
                {
                    "pp_rank": r.pp_rank,
                    "stages": r.stages,
                    "model_states": r.model_states,
                    "peak_bytes": r.memory.peak,
                    "kept_bytes": r.memory.kept,
                    "microbatches_in_flight": r.memory.in_flight,
                    "update_s": r.update_s,
                    "collective_bytes": r.collective_bytes,
                    "sent_bytes_per_microbatch": {
                        f"{stage}{kind}": sum(b.values()) for (stage, kind), b in r.sent.items()
                    },
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
            f"{schedule.microbatches} micro-batches per step, compute {plan.precision.param}",
            describe_zero(plan.zero.stage, plan.pipeline.gather),
            inspection.mesh.describe(),
            "",
            "per pipeline rank (each of its data- and tensor-parallel ranks alike):",
        ]
        for r in self.ranks:
            forward = sum(s for (_, kind), s in r.seconds.items() if kind == "F")
            backward = sum(s for (_, kind), s in r.seconds.items() if kind != "F")
            lines.append(
                f"  rank {r.pp_rank} (stages {r.stages}): model states "
                f"{human_bytes(r.model_states['total'])}{_elsewhere(r.model_states)}, peak "
                f"{human_bytes(r.memory.peak)} "
                f"(kept for backward {human_bytes(r.memory.kept)}: {r.memory.in_flight} "
                f"forward(s) awaiting backward); per micro-batch forward {human_seconds(forward)}, "
                f"backward {human_seconds(backward)}; update {human_seconds(r.update_s)}"
            )
            moved = ", ".join(
                f"{k} {human_bytes(n)}" for k, n in sorted(r.collective_bytes.items())
            )
            lines.append(f"    collectives per step: {moved or 'none'}")
            sent = {
                way: sum(sum(b.values()) for (_, k), b in r.sent.items() if (k == "F") == forward)
                for way, forward in (("forward", True), ("backward", False))
            }
            if any(sent.values()):
                each = ", ".join(f"{human_bytes(n)} {way}" for way, n in sent.items() if n)
                lines.append(f"    sends per micro-batch: {each} (timed on the pp link)")
        lines += [
            "",
            f"time per step: {human_seconds(self.step_s)} (the schedule "
            f"{human_seconds(self.timeline.makespan)}, then the slowest update); bubble "
            f"{self.timeline.bubble:.1%} (the ranks' time spent waiting for a neighbour)",
            "each schedule over these stages, with the same predicted times: its bubble, and "
            "the highest rank's peak memory",
        ]
        for name, bubble in self.bubbles.items():
            if isinstance(bubble, str):
                lines.append(f"  {name:<18}{bubble}")
                continue
            peak = self.peaks.get(name)
            memory = f"  peak {human_bytes(peak)}" if peak is not None else ""
            lines.append(f"  {name:<18}bubble {bubble:6.1%}{memory}")
        lines += ["", f"rates: {self.rates.describe()}"]
        return "\n".join(lines)


def estimate_pipeline(
    plan: Plan,
    world_size: int,
    workload: Workload | None = None,
    rates: DeviceRates | None = None,
    captured: CapturedSteps | None = None,
) -> PipelineEstimate:
    """Compile every pipeline rank of ``plan`` for ``world_size`` ranks (fake tensors: a meta
    model of any size) and predict its memory and the step's time; ``captured``: see
    :func:`inspect_pipeline`."""
    inspection = inspect_pipeline(plan, world_size, workload, captured)
    rates = rates or rates_for(inspection.plan)
    cost = CostModel(rates, world_size, inspection.mesh)
    schedule = inspection.schedule
    gloo = rates.on_gloo

    def seconds(gm: fx.GraphModule) -> float:
        return program_seconds(gm, cost)

    ranks, compiled_ranks = [], []
    for r in range(inspection.mesh.pp):
        compiled = compile_rank(
            inspection.session, inspection.staged, schedule, r, torch.device("cpu")
        )
        states = model_state_bytes_of(compiled.session.layout)
        memory = predict_pipeline_memory(
            schedule.actions[r], compiled.programs, states["total"], gloo=gloo
        )
        times = {k: seconds(gm) if gm is not None else 0.0 for k, gm in compiled.programs.items()}
        update_s = seconds(compiled.update)
        moved = _collective_bytes(compiled, schedule.microbatches)
        sent = {k: sent_bytes(gm) for k, gm in compiled.programs.items() if gm is not None}
        ranks.append(
            RankEstimate(r, schedule.stages_of(r), states, memory, times, update_s, moved, sent)
        )
        compiled_ranks.append(compiled)
    times = {key: s for rank in ranks for key, s in rank.seconds.items()}
    transfer = transfer_seconds({k: b for rank in ranks for k, b in rank.sent.items()}, cost)
    timeline = schedule.simulate(action_seconds(times), transfer)
    peaks = {}
    others = schedules_over(schedule)
    for name, other in others.items():
        if isinstance(other, PipelineSchedule) and other.runs_the_programs_of(schedule):
            peaks[name] = max(
                predict_pipeline_memory(
                    other.actions[r], compiled.programs, rank.model_states["total"], gloo=gloo
                ).peak
                for r, (rank, compiled) in enumerate(zip(ranks, compiled_ranks, strict=True))
            )
    bubbles = {
        name: other.simulate(action_seconds(times), transfer).bubble
        if isinstance(other, PipelineSchedule) else other
        for name, other in others.items()
    }  # fmt: skip
    return PipelineEstimate(inspection, ranks, timeline, bubbles, peaks, rates)


def _elsewhere(states: dict[str, int]) -> str:
    """`` (+ 1.2GiB host, ...)``: the rank's states offload keeps off the device."""
    off = [
        f"{human_bytes(states[where])} {where}" for where in ("host", "nvme") if states.get(where)
    ]
    return f" (+ {', '.join(off)})" if off else ""


def _collective_bytes(compiled: RankPrograms, microbatches: int) -> dict[str, int]:
    """Bytes a pipeline rank's collectives move per step, by kind: each stage program once
    per micro-batch, the update once."""
    moved: Counter[str] = Counter()
    for gm in compiled.programs.values():
        if gm is not None:
            moved.update({k: n * microbatches for k, n in comm_bytes({True: gm}, 1).items()})
    moved.update(comm_bytes({True: compiled.update}, 1))
    return dict(moved)


def program_seconds(gm: fx.GraphModule, cost: CostModel) -> float:
    """One run of a stage program (or the update) as the cost model simulates it."""
    return simulate(gm, cost, issue_s=cost.issue_s, stolen=cost.stolen).step_s


def sent_bytes(gm: fx.GraphModule) -> dict[int, int]:
    """Bytes a stage program sends, by the stage it sends them to."""
    sent: Counter[int] = Counter()
    for node in gm.graph.nodes:
        if op_name(node.target) == "zerocc.send":
            tensor, stage = node.args[0], node.args[1]
            sent[stage] += sum(t.numel() * t.element_size() for t in tensors_in(val(tensor)))
    return dict(sent)


def transfer_seconds(
    sent: dict[tuple[int, str], dict[int, int]], cost: CostModel
) -> Callable[[Dependency, Action], float]:
    """The time what one action sends to the stage of another takes on the ``pp`` link: the
    action's program's sends to that stage (a whole backward's where the schedule runs its
    halves, the input gradient's half where it runs it whole)."""
    other_half = {"B": "I", "I": "B"}

    def of(dependency: Dependency, action: Action) -> float:
        kind, stage, _ = dependency
        sends = sent.get((stage, kind))
        if sends is None:
            sends = sent.get((stage, other_half.get(kind, kind)), {})
        return cost.send_time(sends.get(action.stage, 0))

    return of


def action_seconds(times: dict[tuple[int, str], float]) -> Callable[[Action], float]:
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
