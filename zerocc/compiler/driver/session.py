"""The compile session: one model, one plan, one world size, compiled program after program.

What every program of a step shares is worked out once, here, in one order, for the step
runner (``zerocc.compile``), ``zerocc inspect`` and ``zerocc estimate`` alike: the ranks' mesh,
the model described (whole, and as this rank's slices under tensor parallelism), the plan's
passes bound to their options, the FSDP units and the state layout the passes declare for
them. :meth:`CompileSession.program` then captures the step on a batch and runs the passes for
those units. Nothing here allocates or communicates: a session on a model on the ``meta``
device compiles any size for any world size.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerocc.compiler.capture import LossFn, ModelInfo, describe_model
from zerocc.compiler.driver.pass_manager import PassList, bind_passes, state_layout
from zerocc.compiler.driver.program import CapturedSteps, CompiledProgram, compile_program
from zerocc.compiler.float8 import Float8Layers
from zerocc.compiler.parallel.experts import ExpertParallel
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.tensor_parallel import Split, TensorParallel, local_info
from zerocc.compiler.passes.partition import assign_units, repeated_block
from zerocc.compiler.plan import Plan
from zerocc.compiler.state import StateLayout
from zerocc.compiler.units import Unit
from zerocc.errors import NotSupportedError, PlanWarning

# A pipeline's session (parallel.pp > 1) is opened as any other, but its programs are compiled
# per pipeline rank, once the step is cut (zerocc.compiler.driver.pipeline.compile_rank).
PIPELINE_NOT_YET = (
    "parallel.pp > 1: a pipeline's programs are compiled per pipeline rank, not as one whole "
    "step: `zerocc inspect PLAN` and `zerocc estimate PLAN` show them, and `zerocc train` (or "
    "zerocc.compile(model, plan)) trains them"
)
PIPELINE_STATUS = (
    "a pipeline trains with `zerocc train` or zerocc.compile(model, plan) (a TrainStep, "
    "called with each rank's batch); `zerocc estimate PLAN` predicts each rank's memory and "
    "the step's time"
)


@dataclass(frozen=True)
class ModelSplits:
    """What the ranks split of one model under a plan: the layers tensor parallelism splits
    and the experts expert parallelism does (None without either), and the model as a rank
    holds it (each split parameter's slice). The experts' regions exchange tokens through the
    ``ep`` object the runtime binds: capture and runtime share one."""

    tensor_parallel: TensorParallel | None
    expert_parallel: ExpertParallel | None
    local: ModelInfo

    @staticmethod
    def of(model: nn.Module, full: ModelInfo, plan: Plan) -> ModelSplits:
        """The splits of ``model`` (described whole as ``full``) under ``plan``; PlanError for
        layers or experts it cannot split."""
        tp = TensorParallel.of(model, full, plan)
        ep = ExpertParallel.of(model, full, plan)
        return ModelSplits(tp, ep, local_info(full, _splits(tp, ep)))


@dataclass(frozen=True)
class CompileSession:
    """What the programs of one model, plan and world size share (see the module's doc).

    A pipeline plan's session (``parallel.pp`` > 1) holds the model converted, described and
    split, and the mesh, as any other; its units, layout and programs are each pipeline
    rank's, known once the step is cut: :func:`zerocc.compiler.driver.pipeline.compile_rank`
    narrows it to a rank (:meth:`of_rank`), and until then it holds none."""

    model: nn.Module
    plan: Plan
    world_size: int
    loss_fn: LossFn | None
    mesh: Mesh
    full_model_info: ModelInfo  # every parameter whole (checkpoints name and shape them so)
    tensor_parallel: TensorParallel | None  # the layers the plan splits, if any
    expert_parallel: ExpertParallel | None  # the experts modules it splits, if any
    model_info: ModelInfo  # what a rank holds: each split parameter's slice
    pass_list: PassList
    units: list[Unit]
    layout: StateLayout  # the state every program of the session binds
    float8: Float8Layers | None = None  # the layers it computes in float8, if any
    model_splits: ModelSplits | None = None  # the model as split whole (a pipeline cuts it)

    @classmethod
    def open(
        cls, model: nn.Module, plan: Plan, world_size: int, loss_fn: LossFn | None = None
    ) -> CompileSession:
        """The session of ``model`` under ``plan`` on ``world_size`` ranks; raises PlanError
        for a mesh the world cannot take, layers it cannot split, passes it cannot run in
        order, or units it cannot form. Under a pipeline plan, the session every pipeline rank's
        is narrowed from (see the class): no units yet."""
        mesh = plan_mesh(plan, world_size)
        float8 = Float8Layers.convert(model, plan)  # (before capture describes its layers)
        full = describe_model(model)
        split = ModelSplits.of(model, full, plan)
        tp, ep, model_info = split.tensor_parallel, split.expert_parallel, split.local
        pass_list = bind_passes(plan)
        if mesh.pp > 1:  # (each pipeline rank's units and layout: once the step is cut)
            return cls(model, plan, world_size, loss_fn, mesh, full, tp, ep, model_info,
                       pass_list, [], StateLayout(), float8, split)  # fmt: skip
        units = plan.units
        experts = ep.units(mesh) if ep is not None else None
        assigned = assign_units(
            model_info, mesh.shard_size, units.classes, units.modules, units.min_mb, experts,
            units.blocks_per_unit,
        )
        layout = state_layout(pass_list, assigned, plan)
        _warn_if_gathered_whole(plan, model_info, assigned, mesh)
        return cls(
            model,
            plan,
            world_size,
            loss_fn,
            mesh,
            full,
            tp,
            ep,
            model_info,
            pass_list,
            assigned,
            layout,
            float8,
            split,
        )

    @property
    def pipeline(self) -> bool:
        """Whether the plan is a pipeline's (its programs compiled per pipeline rank)."""
        return self.mesh.pp > 1

    def of_rank(
        self, plan: Plan, held: ModelInfo, pass_list: PassList, units: list[Unit],
        layout: StateLayout,
    ) -> CompileSession:
        """This pipeline session narrowed to one pipeline rank: the model as its stages hold it
        (``held``), compiled under ``plan`` (the stages' plan) by ``pass_list`` into ``units``
        laid out as ``layout``; the mesh, the model described whole and its splits shared."""
        return dataclasses.replace(
            self, plan=plan, model_info=held, pass_list=pass_list, units=units, layout=layout
        )

    def program(
        self,
        batch: Sequence[Any],
        *,
        boundary: bool,
        device: torch.device,
        plan: Plan | None = None,
        keep_graphs: bool = False,
        training: bool = True,
        captured: CapturedSteps | None = None,
    ) -> CompiledProgram:
        """Capture the step on ``batch`` and run the session's passes for its units (see
        :func:`~zerocc.compiler.driver.program.compile_program`; ``captured``: steps captured
        before, reused where they fit). ``plan``: another plan for the same model and world
        (what a plan change would need), with its own passes and units. Not for a pipeline's
        session (NotSupportedError): its programs are compiled per pipeline rank."""
        if self.pipeline:
            raise NotSupportedError(PIPELINE_NOT_YET)
        plan = plan or self.plan
        ours = plan is self.plan
        return compile_program(
            self.model,
            self.model_info,
            plan,
            self.pass_list if ours else bind_passes(plan),
            batch,
            loss_fn=self.loss_fn,
            device=device,
            mesh=self.mesh,
            boundary=boundary,
            units=self.units if ours else None,
            keep_graphs=keep_graphs,
            training=training,
            tensor_parallel=self.tensor_parallel,
            expert_parallel=self.expert_parallel,
            captured=captured,
        )

    @functools.cached_property
    def splits(self) -> dict[str, Split]:
        """Every parameter the ranks split (by FQN, every alias): tensor parallelism's layers
        and expert parallelism's experts; a rank holds its slice (see :meth:`Split.take`).
        Worked out once: checkpoints and ``full_state_dict`` look up every parameter."""
        return _splits(self.tensor_parallel, self.expert_parallel)


def plan_mesh(plan: Plan, world_size: int) -> Mesh:
    """The ranks' mesh ``plan`` lays out on ``world_size`` ranks (PlanError where they cannot
    take it), computed here alone: every session's, and the one an entry that opens no session
    builds once and passes on (plan check, the plan search's candidates, a pipeline's
    inspection). tests/compiler/parallel/test_mesh_once.py holds it so."""
    return Mesh.of_plan(plan, world_size)


def _splits(tp: TensorParallel | None, ep: ExpertParallel | None) -> dict[str, Split]:
    return (tp.splits if tp is not None else {}) | (ep.splits if ep is not None else {})


def _warn_if_gathered_whole(plan: Plan, model: ModelInfo, units: list[Unit], mesh: Mesh) -> None:
    """A PlanWarning when a stage-3 plan over several ranks holds all its trainable parameters
    in one unit: the whole model is then gathered at once, and its peak is stage 2's."""
    trainable = [u for u in units if u.trainable]
    if plan.zero.stage != 3 or mesh.shard_size < 2 or len(trainable) != 1:
        return
    block = repeated_block(model)
    fix = (
        f"units: {{classes: [{block}]}} gathers one {block} at a time"
        if block is not None
        else "units.classes, units.modules or units.min_mb split it"
    )
    why = (
        "units: auto found no repeated block"
        if "auto" in plan.units.classes
        else ("the plan names no units")
    )
    warnings.warn(
        f"zero.stage: 3 with one unit: the whole model is gathered at once, so its peak is "
        f"stage 2's ({why}); {fix}",
        PlanWarning,
        stacklevel=3,
    )
