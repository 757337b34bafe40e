"""``zerocc inspect`` of a pipeline plan (``parallel.pp`` > 1): where the model is cut, what
crosses each cut, and the schedule each pipeline rank walks, with its bubble (issue 47).

The step is captured once on one micro-batch (the rank's batch cut into
``pipeline.microbatches`` along its first dimension), the units are split into stages
(``pipeline.split``: balanced on predicted time, or where the plan says), the captured step is
cut there (:mod:`zerocc.compiler.parallel.stage_cut`), and the plan's schedule is built for the
stages (:mod:`zerocc.compiler.parallel.pipeline_schedule`). Nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.driver.pipeline import capture_microbatch, cut_step
from zerocc.compiler.driver.program import CapturedSteps
from zerocc.compiler.driver.session import PIPELINE_STATUS, CompileSession, ModelSplits
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.pipeline_schedule import PipelineSchedule, pipeline_schedule
from zerocc.compiler.parallel.router_loss import router_loss_lines
from zerocc.compiler.parallel.stage_programs import StagedStep
from zerocc.compiler.plan import Plan, load_plan
from zerocc.compiler.workload import Workload, load_workload
from zerocc.cost.stage_balance import StageSplit, split_units
from zerocc.inspect.estimate import first_batch
from zerocc.runtime.pipeline import microbatches_of


@dataclass
class PipelineInspection:
    """A pipeline plan's cut and schedule, for ``world_size`` ranks."""

    plan: Plan
    mesh: Mesh
    microbatch: tuple[tuple[int, ...], ...]  # shapes of one micro-batch's tensors
    split: StageSplit | None  # None: the plan named the stages' first units
    staged: StagedStep
    schedule: PipelineSchedule
    workload: Workload  # its model and loss, what the ranks' programs compile
    full: ModelInfo  # the model, every parameter whole
    splits: ModelSplits  # the layers and experts the ranks split
    session: CompileSession  # what every pipeline rank's session is narrowed from

    def format(self) -> str:
        pipeline = self.plan.pipeline
        shapes = ", ".join(str(list(s)) for s in self.microbatch)
        lines = [
            f"pipeline: {self.schedule.stages} stages on {self.mesh.pp} pipeline ranks "
            f"(stages_per_rank {self.schedule.stages_per_rank}), schedule "
            f"{pipeline.schedule}, {self.schedule.microbatches} micro-batches of {shapes}",
            self.mesh.describe(),
            "",
            "split (pipeline.split: auto)" if self.split else "split (pipeline.split)",
        ]
        if self.split is not None:
            lines.append(self.split.format())
        lines += ["", "what each stage holds and what crosses each cut", self.staged.format()]
        lines += router_loss_lines(
            [s.forward.gm for s in self.staged.stages],
            self.schedule.microbatches,
            self.mesh.data_parallel,
            pipeline=True,
        )
        lines += ["", "schedule", self.schedule.format(), "", PIPELINE_STATUS]
        return "\n".join(lines)


def inspect_pipeline(
    plan: Plan | str | dict,
    world_size: int,
    workload: Workload | None = None,
    captured: CapturedSteps | None = None,
) -> PipelineInspection:
    """Cut ``plan``'s workload into its pipeline stages and schedule them for ``world_size``
    ranks, on fake tensors; ``captured``: micro-batch steps captured before, a copy of one
    cut where this plan's capture would be the same (a plan search's candidates that differ
    in their schedule or passes, not in their micro-batch or split)."""
    plan = load_plan(plan)
    workload = workload or load_workload(plan)
    # The model converted (float8), described and split once, and the mesh: the session's.
    session = CompileSession.open(workload.model, plan, world_size, workload.loss_fn)
    mesh, full, splits = session.mesh, session.full_model_info, session.model_splits
    pipeline, pp = plan.pipeline, plan.parallel.pp
    microbatches = pipeline.microbatches_of(pp)
    batch = microbatches_of(first_batch(workload, mesh.data_parallel), microbatches)[0]
    key = CapturedSteps.key(workload.model, workload.loss_fn, plan, batch, training=True)
    kept = captured.get(key) if captured is not None else None
    if kept is not None:
        gm = kept[0]
    else:
        gm = capture_microbatch(workload.model, splits, plan, workload.loss_fn, batch,
                                torch.device("cpu"))  # fmt: skip
        if captured is not None:
            captured.put(key, gm, "")
    stage_units, split = split_units(plan, gm, splits.local, mesh.shard_size)
    staged = cut_step(gm, splits.local, stage_units, plan, mesh)
    schedule = pipeline_schedule(pipeline.schedule, pp, microbatches, pipeline.stages_per_rank_of())
    shapes = tuple(tuple(b.shape) for b in batch if isinstance(b, torch.Tensor))
    return PipelineInspection(plan, mesh, shapes, split, staged, schedule, workload, full, splits,
                              session)  # fmt: skip
