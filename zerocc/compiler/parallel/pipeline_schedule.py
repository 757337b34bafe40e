"""Pipeline schedules as data: which stage each pipeline rank runs, on which micro-batch, in what
order (issue 47: pipeline parallelism; this is the schedule the runtime will walk).

A model cut into ``pp × V`` stages (``V`` stages per rank) trains each micro-batch through every
stage forward (``F``) and back (``B``; a zero-bubble schedule splits it into the input
gradient ``I``, which the stage before waits for, and the weight gradient ``W``, which nothing
waits for). A schedule is one list of such actions per rank. :meth:`PipelineSchedule.simulate`
runs the lists against the dependencies between stages (``F`` of stage ``s`` after ``F`` of
``s-1``; ``B``/``I`` of ``s`` after its own ``F`` and ``B``/``I`` of ``s+1``; ``W`` after ``I``)
with a cost per action, and gives each rank's idle share: the bubble. With ``F`` = 1 and
``B`` = 2, GPipe's and 1F1B's bubble is ``(pp-1)/(M+pp-1)`` exactly (tested).

GPipe and 1F1B are written here. The interleaved 1F1B and the zero-bubble (ZBV) orders are
torch's (``torch.distributed.pipelining``), computed for every rank by its own schedule classes
and checked here like ours: every stage runs every micro-batch's forward and backward once, on
the rank that holds the stage, in an order that cannot deadlock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from zerocc.compiler.plan.pipeline import SCHEDULES as SCHEDULES  # (re-exported)
from zerocc.compiler.plan.pipeline import check_schedule
from zerocc.errors import PlanError

ActionKind = Literal["F", "B", "I", "W"]
Dependency = tuple[str, int, int]  # (kind, stage, micro-batch) of the action waited for
# torch.distributed.pipelining's names of the schedules taken from it
_TORCH_NAMES = {"interleaved-1f1b": "Interleaved1F1B", "zero-bubble": "ZBVZeroBubble"}
# The cost of each kind of action when none is given: a backward is twice a forward, split
# evenly between the input gradient and the weight gradient.
UNIT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    """One stage's forward or backward (or its half) of one micro-batch."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """What :meth:`PipelineSchedule.simulate` found: each action's start and end, per rank."""

    spans: tuple[tuple[tuple[Action, float, float], ...], ...]  # per rank, in order
    makespan: float

    @property
    def bubble(self) -> float:
        """The share of the ranks' time they sit idle: 1 - busy / (ranks × makespan)."""
        busy = sum(end - start for rank in self.spans for _, start, end in rank)
        return 1.0 - busy / (len(self.spans) * self.makespan)


@dataclass(frozen=True)
class PipelineSchedule:
    """The actions of ``pp`` ranks over ``microbatches`` micro-batches, ``stages_per_rank``
    stages each; ``actions[r]`` is rank ``r``'s list, in the order it runs them."""

    name: str
    pp: int
    microbatches: int
    stages_per_rank: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        """How many stages the model is cut into."""
        return self.pp * self.stages_per_rank

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Whether a stage's backward runs in two halves, ``I`` then ``W`` (zero-bubble)."""
        return any(a.kind == "I" for a in self.actions[0])

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in order."""
        return sorted({a.stage for a in self.actions[rank]})

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        for rank, actions in enumerate(self.actions):
            if any(a.stage == stage for a in actions):
                return rank
        raise KeyError(f"stage {stage} is on no rank")

    def simulate(
        self,
        costs: Mapping[str, float] | Callable[[Action], float] = UNIT_COSTS,
        transfer: Callable[[Dependency, Action], float] | None = None,
    ) -> Timeline:
        """Run every rank's actions in order, each as soon as its rank is free and what it
        depends on has ended (``costs``: the time of each kind of action, or of each action:
        a stage's predicted time) and, from another rank, arrived (``transfer(dependency,
        action)``: the seconds what the dependency sends to the action's stage takes on the
        link; none without it). Raises ValueError naming the actions that wait for each other
        when the order deadlocks."""
        cost = costs if callable(costs) else (lambda action: costs[action.kind])
        rank_of = {a.stage: r for r, actions in enumerate(self.actions) for a in actions}
        ends: dict[tuple[str, int, int], float] = {}
        free = [0.0] * self.pp
        cursor = [0] * self.pp
        spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(self.pp)]
        remaining = sum(len(a) for a in self.actions)
        while remaining:
            progressed = False
            for rank, actions in enumerate(self.actions):
                while cursor[rank] < len(actions):
                    action = actions[cursor[rank]]
                    dependencies = self._dependencies(action)
                    needed = [ends.get(d) for d in dependencies]
                    if any(end is None for end in needed):
                        break
                    if transfer is not None:
                        needed = [
                            end + transfer(d, action) if rank_of[d[1]] != rank else end
                            for d, end in zip(dependencies, needed, strict=True)
                        ]
                    start = max([free[rank], *needed])  # type: ignore[list-item]
                    end = start + cost(action)
                    ends[action.kind, action.stage, action.microbatch] = end
                    spans[rank].append((action, start, end))
                    free[rank], cursor[rank] = end, cursor[rank] + 1
                    remaining, progressed = remaining - 1, True
            if not progressed:
                waiting = [
                    str(a[c]) for a, c in zip(self.actions, cursor, strict=True) if c < len(a)
                ]
                raise ValueError(f"{self.name}: the ranks wait for each other at {waiting}")
        return Timeline(tuple(tuple(s) for s in spans), max(free))

    def runs_the_programs_of(self, other: PipelineSchedule) -> bool:
        """Whether this schedule runs the programs ``other``'s ranks were compiled for: the
        same stages on each rank, the backward whole or halved alike."""
        return self.splits_backward == other.splits_backward and all(
            self.stages_of(r) == other.stages_of(r) for r in range(other.pp)
        )

    def _dependencies(self, action: Action) -> list[Dependency]:
        s, m, last = action.stage, action.microbatch, self.stages - 1
        if action.kind == "F":
            return [("F", s - 1, m)] if s > 0 else []
        if action.kind == "W":
            return [("I", s, m)]
        after = [] if s == last else [(self._input_gradient_kind, s + 1, m)]
        return [("F", s, m), *after]

    @property
    def _input_gradient_kind(self) -> str:
        """What a stage's backward waits for from the stage after it: ``I`` where backward is
        split, else ``B``."""
        return "I" if self.splits_backward else "B"

    def check(self) -> None:
        """Raise ValueError unless every stage runs the forward and the backward (whole, or
        ``I`` and ``W``) of every micro-batch exactly once, each stage on one rank, in an
        order that does not deadlock."""
        seen: dict[tuple[str, int, int], int] = {}
        for rank, actions in enumerate(self.actions):
            for a in actions:
                key = (a.kind, a.stage, a.microbatch)
                if key in seen:
                    raise ValueError(f"{self.name}: {a} runs twice (ranks {seen[key]}, {rank})")
                seen[key] = rank
        backward = ("I", "W") if self._input_gradient_kind == "I" else ("B",)
        for stage in range(self.stages):
            for m in range(self.microbatches):
                for kind in ("F", *backward):
                    if (kind, stage, m) not in seen:
                        raise ValueError(f"{self.name}: {stage}{kind}{m} never runs")
                ranks = {seen[k, stage, m] for k in ("F", *backward)}
                if len(ranks) > 1:
                    raise ValueError(f"{self.name}: stage {stage} runs on ranks {sorted(ranks)}")
        self.simulate()

    def format(self, costs: Mapping[str, float] = UNIT_COSTS) -> str:
        """Each rank's actions in order, then the simulated bubble with ``costs``."""
        width = max(len(str(a)) for actions in self.actions for a in actions)
        lines = [
            f"rank {r}: " + " ".join(str(a).ljust(width) for a in actions)
            for r, actions in enumerate(self.actions)
        ]
        timeline = self.simulate(costs)
        lines.append(
            f"{self.name}: {self.pp} ranks × {self.stages_per_rank} stage(s), "
            f"{self.microbatches} micro-batches: bubble {timeline.bubble:.1%} "
            f"(F {costs['F']:g}, B {costs['B']:g}, I {costs['I']:g}, W {costs['W']:g})"
        )
        return "\n".join(lines)


def pipeline_schedule(
    name: str, pp: int, microbatches: int, stages_per_rank: int = 1
) -> PipelineSchedule:
    """The ``name`` schedule (one of :data:`SCHEDULES`) of ``pp`` ranks over ``microbatches``
    micro-batches, checked (:meth:`PipelineSchedule.check`); PlanError naming the plan's field
    for a combination the schedule cannot run."""
    check_schedule(name, pp, microbatches, stages_per_rank)
    if name == "gpipe":
        actions = [_gpipe(rank, microbatches) for rank in range(pp)]
    elif name == "1f1b":
        actions = [_one_f_one_b(rank, pp, microbatches) for rank in range(pp)]
    else:
        actions = _from_torch(name, pp, microbatches, stages_per_rank)
    schedule = PipelineSchedule(name, pp, microbatches, stages_per_rank, tuple(map(tuple, actions)))
    schedule.check()
    return schedule


def schedules_over(planned: PipelineSchedule) -> dict[str, PipelineSchedule | str]:
    """Every schedule over ``planned``'s ranks, stages per rank and micro-batches, or why it
    cannot run them (the first clause of its PlanError)."""
    schedules: dict[str, PipelineSchedule | str] = {}
    for name in SCHEDULES:
        try:
            schedules[name] = pipeline_schedule(
                name, planned.pp, planned.microbatches, planned.stages_per_rank
            )
        except PlanError as error:
            schedules[name] = f"(not over these stages: {str(error).split(';')[0]})"
    return schedules


def _gpipe(rank: int, microbatches: int) -> list[Action]:
    """Every forward, then every backward."""
    forward = [Action("F", rank, m) for m in range(microbatches)]
    return forward + [Action("B", rank, m) for m in range(microbatches)]


def _one_f_one_b(rank: int, pp: int, microbatches: int) -> list[Action]:
    """As many forwards as stages after this one (the warm-up), then one forward and one
    backward in turn, then the backwards left: at most ``pp - rank`` micro-batches' activations
    held at once, where GPipe holds all of them."""
    warmup = min(pp - 1 - rank, microbatches)
    actions = [Action("F", rank, m) for m in range(warmup)]
    for m in range(warmup, microbatches):
        actions += [Action("F", rank, m), Action("B", rank, m - warmup)]
    return actions + [Action("B", rank, m) for m in range(microbatches - warmup, microbatches)]


def _from_torch(name: str, pp: int, microbatches: int, stages_per_rank: int) -> list[list[Action]]:
    """The orders of torch's schedule classes for every rank (``get_schedule_ops`` builds a
    schedule on stand-in stages), its compute actions only."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        ops = get_schedule_ops(_TORCH_NAMES[name], pp, microbatches, stages_per_rank)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise PlanError(
            f"pipeline: {name} cannot run {microbatches} micro-batches on {pp} ranks × "
            f"{stages_per_rank} stages: {e}"
        ) from e
    compute = {"F", "B", "I", "W"}  # (torch's lists also hold communication and reductions)
    return [
        [
            Action(op.computation_type.value, op.stage_index, op.microbatch_index)
            for op in rank
            if op is not None and op.computation_type.value in compute
        ]
        for rank in ops
    ]
