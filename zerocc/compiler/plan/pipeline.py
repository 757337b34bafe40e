"""The ``pipeline`` section: how a model cut into stages over ``parallel.pp`` ranks runs its
micro-batches (issue 47), and the checks every schedule's arguments pass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, field_validator

from zerocc.compiler.plan.base import Section
from zerocc.errors import PlanError

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
GatherName = Literal["step", "microbatch"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
# Stages per rank each schedule runs: (least, most; None: no bound). ZBV is V-shaped: two.
STAGES_PER_RANK: Mapping[str, tuple[int, int | None]] = {
    "gpipe": (1, 1),
    "1f1b": (1, 1),
    "interleaved-1f1b": (2, None),
    "zero-bubble": (2, 2),
}


class PipelineConfig(Section):
    """The schedule of a pipeline's micro-batches and where its stages are cut."""

    schedule: ScheduleName = Field(
        "1f1b",
        description="gpipe (every forward, then every backward), 1f1b (one forward, one "
        "backward: activations of at most pp micro-batches held), interleaved-1f1b "
        "(stages_per_rank stages per rank, a smaller bubble), zero-bubble (ZBV: two stages per "
        "rank, backward split into input and weight gradients)",
    )
    microbatches: int | None = Field(
        None,
        ge=2,
        description="micro-batches each rank's batch is cut into (its first dimension must "
        "divide), 2 or more: their gradients accumulate; default: parallel.pp x "
        "stages_per_rank. The bubble is (pp-1)/(M+pp-1) of 1f1b's time",
    )
    stages_per_rank: int | None = Field(
        None, ge=1, description="stages each rank holds; default: 1, or 2 for the schedules "
        "that need more"
    )  # fmt: skip
    split: Literal["auto"] | list[str] = Field(
        "auto",
        description="auto: units cut into stages of even predicted time (the first and last "
        "lighter for the embedding and the head); or the unit each stage after the first "
        "begins with, pp x stages_per_rank - 1 of them, in model order",
    )

    gather: GatherName = Field(
        "step",
        description="zero.stage 3: when a stage's parameters are gathered. step: once per step "
        "and held whole through it, as ZeRO-2 holds them (one all-gather per unit and step; the "
        "stage's parameters whole in memory); microbatch: before each micro-batch's forward and "
        "backward and freed after (one unit whole at a time; 2 x microbatches all-gathers per "
        "unit and step)",
    )

    @field_validator("split")
    @classmethod
    def _split_names_units_once(cls, split: str | list[str]) -> str | list[str]:
        if isinstance(split, list) and len(set(split)) != len(split):
            raise ValueError(f"{split} names a unit twice: each stage begins at its own unit")
        return split

    def stages_per_rank_of(self) -> int:
        """``stages_per_rank``, or the schedule's least."""
        return self.stages_per_rank or STAGES_PER_RANK[self.schedule][0]

    def microbatches_of(self, pp: int) -> int:
        """``microbatches``, or one per stage."""
        return self.microbatches or pp * self.stages_per_rank_of()


def stages_zero(stage: int, gather: str) -> int:
    """The ZeRO stage a pipeline's stage programs are compiled at for the plan's ``stage``:
    stage 3 gathering once per step (``pipeline.gather: step``) holds a stage's parameters
    whole through the step, which is what stage 2 does (its update all-gathers the new
    parameters once, where stage 3 would gather them before the next step's first forward:
    the same bytes, the same peak)."""
    return 2 if stage == 3 and gather == "step" else stage


def less_gathered(stage: int, gather: str) -> str | None:
    """The plan change that holds fewer of a stage's parameters whole, if there is one."""
    if stage == 3 and gather == "microbatch":
        return None
    change = "pipeline.gather: microbatch"
    if stage != 3:
        change = f"zero.stage: 3, {change}"
    return f"{change} (each stage's parameters gathered per micro-batch: one unit whole at a time)"


def describe_zero(stage: int, gather: str) -> str:
    """How ZeRO runs inside a pipeline's stages, for the explain and the estimate."""
    if stage != 3:
        return f"ZeRO stage {stage} inside each stage"
    if gather == "step":
        return (
            "ZeRO stage 3 inside each stage, its parameters gathered once per step and held "
            "whole through it (pipeline.gather: step; as ZeRO-2 holds them)"
        )
    return (
        "ZeRO stage 3 inside each stage, its parameters gathered for each micro-batch's "
        "forward and backward (pipeline.gather: microbatch)"
    )


def check_schedule(name: str, pp: int, microbatches: int, stages_per_rank: int) -> None:
    """PlanError naming the plan's field when schedule ``name`` cannot run ``microbatches``
    micro-batches on ``pp`` ranks of ``stages_per_rank`` stages each."""
    if name not in SCHEDULES:
        raise PlanError(f"pipeline.schedule: {name!r} is not a schedule; one of {list(SCHEDULES)}")
    if pp < 2:
        raise PlanError(f"parallel.pp: a pipeline needs 2 or more stages' ranks, got {pp}")
    if microbatches < 1:
        raise PlanError(f"pipeline.microbatches: must be 1 or more, got {microbatches}")
    least, most = STAGES_PER_RANK[name]
    if stages_per_rank < least or (most is not None and stages_per_rank > most):
        runs = f"{least}" if least == most else f"{least} or more"
        raise PlanError(
            f"pipeline.stages_per_rank: {name} runs {runs} stage(s) per rank, got {stages_per_rank}"
        )
