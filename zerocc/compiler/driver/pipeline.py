"""A pipeline rank's programs, compiled without running anything (issue 47): what a pipeline's
step (:mod:`zerocc.runtime.pipeline_rank`) lowers and runs, and what ``zerocc estimate`` predicts.

The step is captured once on one micro-batch (:func:`capture_microbatch`: under tensor and
expert parallelism in its split form, each split parameter as a rank's slice, each experts
module's call a region exchanging its tokens over ``ep``) and cut into stages
(:mod:`zerocc.compiler.parallel.stage_cut`; the split is the caller's, balanced by the cost
model). :func:`compile_rank` then compiles what one pipeline rank runs: the rank holds the
parameters its stages read, in units of its own (a parameter another pipeline rank holds too,
a tied embedding, in a unit by itself, laid out alike on both), and each of its stages'
programs (forward, backward or its two halves) goes through the plan's passes as a micro-batch
that accumulates; one update program reduces what the micro-batches accumulated, sums a tied
unit's gradient with the other rank holding it, agrees the overflow flag and the clipping norm
over the pipeline, and updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from zerocc.compiler.capture import LossFn, ModelInfo
from zerocc.compiler.driver.pass_manager import (
    PassContext,
    PassList,
    PassRecord,
    bind_passes,
    run_passes,
    state_layout,
)
from zerocc.compiler.driver.program import capture_split, check_bindings, snapshot
from zerocc.compiler.driver.session import CompileSession, ModelSplits
from zerocc.compiler.parallel.experts import ExpertParallel
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.pipeline_schedule import PipelineSchedule
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import (
    StagedStep,
    split_backward,
    stage_model,
    step_form,
    update_graph,
)
from zerocc.compiler.parallel.tensor_parallel import TensorParallel
from zerocc.compiler.passes.partition import assign_units
from zerocc.compiler.passes.recompute import recompute
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.pipeline import stages_zero
from zerocc.compiler.state import StateLayout
from zerocc.compiler.units import Unit
from zerocc.ir.fake_values import propagate_fake_values


def stage_plan(plan: Plan) -> Plan:
    """The plan a pipeline's stage programs are compiled under: what accumulates over a step's
    micro-batches is compiled as gradient accumulation (so the mean is over ranks ×
    micro-batches, as in any step), at the ZeRO stage that gathers parameters as
    ``pipeline.gather`` asks (:func:`stages_zero`); recompute was applied before the cut
    (:func:`cut_step`)."""
    pipeline = plan.pipeline
    microbatches = pipeline.microbatches_of(plan.parallel.pp)
    zero = plan.zero.model_copy(update={"stage": stages_zero(plan.zero.stage, pipeline.gather)})
    recomputed = plan.recompute.model_copy(update={"units": "none"})
    return plan.model_copy(
        update={"grad_accumulation": microbatches, "zero": zero, "recompute": recomputed}
    )


def cut_step(
    gm: fx.GraphModule,
    local: ModelInfo,
    stage_units: Sequence[Sequence[str]],
    plan: Plan,
    mesh: Mesh,
) -> StagedStep:
    """The captured step ``gm`` cut into the stages of ``stage_units``, the units
    ``recompute.units`` names recomputed first: their forward copied into their backward (the
    recompute pass, on the whole step), so that the cut keeps only such a unit's inputs from a
    stage's forward to its backward. (A stage program could not recompute: its backward reads
    what its forward kept, not the forward's nodes.)"""
    if plan.recompute.units != "none":
        units = plan.units
        assigned = assign_units(local, mesh.shard_size, units.classes, units.modules,
                                units.min_mb)  # fmt: skip
        ctx = PassContext(plan, mesh, local, boundary=False, units=assigned)
        gm = recompute(gm, ctx, units=plan.recompute.units)
        propagate_fake_values(gm)  # (the generator states it saves for the replay)
    return cut_stages(gm, local, stage_units)


def capture_microbatch(
    model: nn.Module,
    splits: ModelSplits,
    plan: Plan,
    loss_fn: LossFn | None,
    microbatch: Sequence[Any],
    device: torch.device,
    gradients: bool = True,
) -> fx.GraphModule:
    """The step of one micro-batch captured as a rank runs it, with its ``splits`` (its
    layers' and experts' slices; ``gradients=False``: its forward alone, in eval mode, for
    evaluation)."""
    return capture_split(model, splits.local, plan, loss_fn, microbatch, device, gradients,
                         splits.tensor_parallel, splits.expert_parallel)  # fmt: skip


@dataclass
class RankPrograms:
    """One pipeline rank's compiled programs: its session (the model as it holds it, its units
    and their layout), its stages' programs by ``(stage, kind)`` (None: nothing to run, as the
    first stage's input gradient), and its update."""

    session: CompileSession
    programs: dict[tuple[int, str], fx.GraphModule | None]
    update: fx.GraphModule
    compiler: RankCompiler  # compiles more of the rank's programs (its evaluation)

    @property
    def records(self) -> dict[str, list[PassRecord]]:
        """What each pass did, by program name (:func:`program_name`)."""
        return self.compiler.records


@dataclass
class RankCompiler:
    """What compiling a pipeline rank's programs needs: the stage plan, the rank's model, units
    and layout, the units it shares with another pipeline rank, and the passes."""

    plan: Plan  # the stage plan (stage_plan)
    mesh: Mesh  # the ranks' layout (the user's plan's)
    pp_rank: int
    held: ModelInfo
    units: list[Unit]
    layout: StateLayout
    pass_list: PassList
    tensor_parallel: TensorParallel | None
    expert_parallel: ExpertParallel | None
    tied_units: frozenset[str]
    counts_tied: bool  # this rank counts the tied units in the clipping norm
    keep_graphs: bool
    records: dict[str, list[PassRecord]] = field(default_factory=dict)

    def program(
        self,
        key: tuple[int, str] | None,
        graph: fx.GraphModule,
        update_of: frozenset[str] | None = None,
    ) -> fx.GraphModule:
        """``graph`` (a stage program in step form, or the update's for ``key`` None) through
        the passes, its bindings checked against the rank's layout."""
        ctx = PassContext(
            self.plan, self.mesh, self.held, boundary=key is None, units=self.units,
            update_of=update_of, tied=self.tied_units, tied_norm=self.counts_tied,
            tensor_parallel=self.tensor_parallel, expert_parallel=self.expert_parallel,
        )  # fmt: skip
        gm, self.records[program_name(self.pp_rank, key)] = run_passes(
            graph, ctx, self.pass_list, snapshot if self.keep_graphs else None
        )
        check_bindings(gm, self.layout, self.held)
        return gm

    def evaluation(self, staged: StagedStep, stages: list[int]) -> dict[int, fx.GraphModule]:
        """The forward of each of ``stages`` of ``staged`` (a forward-only step, cut as the
        training one), compiled: what evaluating a batch runs (nothing kept, nothing
        accumulated; the last stage returns the loss)."""
        return {
            s: self.program((s, "eval"), step_form(staged.stages[s].forward, self.held))
            for s in stages
        }


def program_name(pp_rank: int, key: tuple[int, str] | None) -> str:
    """A pipeline rank's program as dumps and reports name it: ``rank0-stage1-F``, or
    ``rank0-update`` (``key`` None)."""
    return f"rank{pp_rank}-" + ("update" if key is None else f"stage{key[0]}-{key[1]}")


def compile_rank(
    session: CompileSession,
    staged: StagedStep,
    schedule: PipelineSchedule,
    pp_rank: int,
    device: torch.device,
    keep_graphs: bool = False,
) -> RankPrograms:
    """Compile what pipeline rank ``pp_rank`` runs of ``staged`` (cut from the step of
    ``session``'s model, split as it splits it, as :func:`capture_microbatch` captured it)
    under ``session``'s plan (the user's) on the ranks of its mesh (the run's);
    ``keep_graphs`` keeps a copy of each program after every pass in its records (for the
    dumps). The rank's session is ``session`` narrowed to its stages."""
    mesh, plan = session.mesh, stage_plan(session.plan)
    tp, ep, local = session.tensor_parallel, session.expert_parallel, session.model_info
    mine = schedule.stages_of(pp_rank)
    held = stage_model(local, *(staged.stages[s] for s in mine))
    holds = {p.fqn for p in held.params}
    tied = frozenset(
        fqn for fqn, stages in staged.tied.items()
        if len({schedule.rank_of(s) for s in stages}) > 1 and fqn in holds
    )  # fmt: skip
    units = _units(held, tied, mesh, plan, ep)
    pass_list = bind_passes(plan)
    layout = state_layout(pass_list, units, plan)
    session = session.of_rank(plan, held, pass_list, units, layout)
    compiler = RankCompiler(
        plan, mesh, pp_rank, held, units, layout, pass_list, tp, ep,
        tied_units=frozenset(f"tied.{fqn}" for fqn in tied),
        # One of the pipeline ranks holding a tied unit counts it in the norm: the first.
        counts_tied=all(pp_rank <= schedule.rank_of(s) for f in tied for s in staged.tied[f]),
        keep_graphs=keep_graphs,
    )  # fmt: skip
    programs: dict[tuple[int, str], fx.GraphModule | None] = {}
    reached: set[str] = set()
    for s in mine:
        stage = staged.stages[s]
        kinds = {"F": stage.forward, "B": stage.backward}
        if schedule.splits_backward:
            del kinds["B"]
            kinds["I"], kinds["W"] = split_backward(stage.backward)
        for kind, program in kinds.items():
            reached.update(program.writes("grad"))
            if not program.outputs:  # (the first stage's input gradient, mostly)
                programs[s, kind] = None
                continue
            programs[s, kind] = compiler.program((s, kind), step_form(program, held))
    # A tied unit is reduced and updated on both ranks that hold it, whichever of them
    # computed its gradient (under mixed precision the cast's gradient sums both parts on
    # the first stage: the other's accumulator holds zeros).
    reached |= tied
    scaled = plan.precision.scaling != "none"
    update = compiler.program(None, update_graph(held, device, scaled), frozenset(reached))
    return RankPrograms(session, programs, update, compiler)


def _units(
    held: ModelInfo, tied: frozenset[str], mesh: Mesh, plan: Plan, ep: ExpertParallel | None
) -> list[Unit]:
    """A rank's units as the plan groups its parameters (experts modules apart, on their
    ``edp`` ranks, under expert parallelism), but a parameter another pipeline rank holds
    too: in a unit of its own, laid out alike on both (its gradient is summed between
    them)."""
    shard_size = mesh.shard_size
    rest = ModelInfo(tuple(p for p in held.params if p.fqn not in tied), held.buffers,
                     held.modules)  # fmt: skip
    experts = ep.units(mesh) if ep is not None else None
    units = assign_units(rest, shard_size, plan.units.classes, plan.units.modules,
                         plan.units.min_mb, experts)  # fmt: skip
    by_fqn = {p.fqn: p for p in held.params}
    return units + [Unit.build(f"tied.{fqn}", [by_fqn[fqn]], shard_size) for fqn in sorted(tied)]
