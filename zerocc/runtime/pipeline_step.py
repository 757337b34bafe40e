"""A pipeline rank's training step (``parallel.pp`` > 1, issue 47): the step cut into stages,
the rank's stages compiled by the plan's passes, their actions walked, then one update.

On the first call the step is captured on one micro-batch, the units are split into stages
(``pipeline.split``) and the step cut there (:mod:`zerocc.compiler.parallel.stage_cut`). The
rank holds the parameters its stages read, in units of its own (a parameter another pipeline
rank holds too, an embedding tied to the head, in a unit by itself, laid out alike on both),
sharded over its stage's data-parallel ranks as the plan's ZeRO stage says. Each of its stages'
programs (forward, backward or its two halves) is compiled by the plan's passes as a
micro-batch that accumulates: gathers, frees and reductions as in any step. After the rank has
walked its schedule (:class:`zerocc.runtime.pipeline.PipelineRank`), one update program reduces
what the micro-batches accumulated, sums a tied unit's gradient with the other rank holding
it, agrees the overflow flag and the clipping norm over the pipeline, and updates. The loss is
the mean over the micro-batches of the last stage's, on every rank.

What a pipeline does not do yet is refused when it is compiled, naming the field:
tensor parallelism beside it, offload, loss scaling, the Inductor backend, and evaluation,
checkpoints and the other TrainStep methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from zerocc.backends import Executable, get_backend, resolve_backend
from zerocc.compiler.capture import (
    Casts,
    LossFn,
    ModelInfo,
    capture,
    describe_model,
    detach_inputs,
    traced_grad_mode,
)
from zerocc.compiler.driver.pass_manager import PassContext, bind_passes, run_passes, state_layout
from zerocc.compiler.driver.program import check_bindings
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.pipeline_schedule import Action, pipeline_schedule
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import (
    StagedStep,
    split_backward,
    stage_model,
    step_form,
    update_graph,
)
from zerocc.compiler.passes.partition import assign_units
from zerocc.compiler.plan import Plan
from zerocc.compiler.schedule import lr_at
from zerocc.compiler.state import LR_SPEC, STEP_SPEC
from zerocc.compiler.units import Unit
from zerocc.cost.stage_balance import split_units
from zerocc.engine.comm import Comm
from zerocc.errors import NotSupportedError
from zerocc.ir.nodes import BATCH, placeholders, val
from zerocc.ir.ops import DP_GROUP, PP_GROUP
from zerocc.runtime.context import open_context
from zerocc.runtime.nonfinite import nonfinite_error
from zerocc.runtime.pipeline import PipelineRank, TorchTransport, microbatches_of
from zerocc.runtime.programs import SetupClock, bindings_of
from zerocc.runtime.state_store import StateStore


@dataclass
class _Program:
    """A compiled program of the rank, lowered: what its placeholders bind, and its run."""

    gm: fx.GraphModule
    bindings: list[tuple[str, str]]
    run: Executable


class PipelineStep:
    """One rank of a pipeline-parallel training step: ``step(*batch)`` trains on the rank's
    batch (the same on every rank of one pipeline), cut into ``pipeline.microbatches``, and
    returns the mean loss; ``full_state_dict()`` gathers the parameters this rank's stages
    hold (a collective over its stage's data-parallel ranks)."""

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        _check_supported(plan, device)
        self.model, self.plan, self.loss_fn, self.comm, self.device = (
            model, plan, loss_fn, comm, device
        )  # fmt: skip
        self.mesh = Mesh.of_plan(plan, comm.world_size)
        comm.use_mesh(self.mesh)
        pipeline, pp = plan.pipeline, plan.parallel.pp
        self.microbatches = pipeline.microbatches_of(pp)
        self.schedule = pipeline_schedule(
            pipeline.schedule, pp, self.microbatches, pipeline.stages_per_rank_of()
        )
        self.pp_rank = self.mesh.pp_rank(comm.rank)
        self.pipeline_ranks = next(g for g in self.mesh.groups(PP_GROUP) if comm.rank in g)
        # What accumulates over the micro-batches of a step is compiled as accumulation.
        self.stage_plan = plan.model_copy(update={"grad_accumulation": self.microbatches})
        self.steps = 0
        self.staged: StagedStep | None = None  # built at the first call (a batch's shapes)
        # The last step's actions on this rank: (action, start, end, waited), seconds from the
        # first action's start; ``waited``: the part of it spent receiving a neighbour's tensor.
        self.timeline: list[tuple[Action, float, float, float]] = []

    # -- the step ---------------------------------------------------------------------------

    def __call__(self, *batch: Any) -> torch.Tensor:
        """Train one step on this rank's ``batch``; returns the mean loss of its micro-batches."""
        batch = tuple(b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch)
        micro = microbatches_of(batch, self.microbatches)
        if self.staged is None:
            self._build(micro[0])
        self.state[LR_SPEC.key].fill_(lr_at(self.plan.optimizer, self.steps))
        if STEP_SPEC.key in self.state:
            self.state[STEP_SPEC.key].fill_(self.steps + 1)
        runners = {key: self._runner(program, micro) for key, program in self.programs.items()}
        rank = PipelineRank(runners, self.transport)
        self.timeline = []
        with traced_grad_mode():
            start = time.perf_counter()
            for action in self.schedule.actions[self.pp_rank]:
                began, waited = time.perf_counter() - start, rank.waited
                rank.run(action)
                end = time.perf_counter() - start
                self.timeline.append((action, began, end, rank.waited - waited))
            self.transport.finish()
            _, flags, found_inf = self.update.run(*self._bound(self.update.bindings, ()))
        if bool(found_inf):
            if STEP_SPEC.key in self.state:
                self.state[STEP_SPEC.key].fill_(self.steps)
            if self.plan.precision.nonfinite == "error":
                raise nonfinite_error(self.update.gm, flags, self.comm.rank, self.steps + 1)
        else:
            self.steps += 1
        return self._loss(rank.losses)

    @property
    def data_rank(self) -> int:
        """Which batch of each step this rank trains on (the ranks of a pipeline share it)."""
        return self.mesh.data_rank(self.comm.rank)

    @property
    def data_parallel(self) -> int:
        """How many batches one step trains on."""
        return self.mesh.data_parallel

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (0 to pp - 1) that holds ``stage``."""
        return self.schedule.rank_of(stage)

    def _runner(self, program: _Program | None, micro: list[tuple]) -> Callable[[int], Any]:
        def run(microbatch: int) -> Any:
            if program is None:  # a program with nothing to do
                return None
            return program.run(*self._bound(program.bindings, micro[microbatch]))

        return run

    def _bound(self, bindings: list[tuple[str, str]], batch: tuple) -> list[Any]:
        return detach_inputs(
            [batch[int(k)] if role == BATCH else self.state[k] for role, k in bindings]
        )

    def _loss(self, losses: dict[int, Any]) -> torch.Tensor:
        """The mean loss of the step's micro-batches (the last stage's), on every rank: summed
        over the pipeline's ranks, where only the last stage's is not zero."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            loss += torch.stack([losses[m].float() for m in sorted(losses)]).mean()
        self.comm.on(PP_GROUP).all_reduce(loss).wait()
        return loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full tensor}`` of the parameters and buffers this rank's stages hold (a
        collective over the stage's data-parallel ranks)."""
        if self.staged is None:
            raise RuntimeError("a pipeline's state exists from its first step on")
        return self.state.full_state_dict()

    # -- building ---------------------------------------------------------------------------

    def _build(self, microbatch: tuple) -> None:
        """Capture the step on ``microbatch``, cut it, lay out and allocate this rank's state
        and compile its programs."""
        full = describe_model(self.model)
        casts = Casts.of(self.plan.precision)
        gm = capture(self.model, full, self.loss_fn, microbatch, self.device, casts)
        stage_units, _ = split_units(self.plan, gm, full, self.mesh.shard_size)
        staged = cut_stages(gm, full, stage_units)
        mine = self.schedule.stages_of(self.pp_rank)
        held = stage_model(full, *(staged.stages[s] for s in mine))
        holds = {p.fqn for p in held.params}
        tied = {
            fqn for fqn, stages in staged.tied.items()
            if len({self.rank_of(s) for s in stages}) > 1 and fqn in holds
        }  # fmt: skip
        units = _units(held, tied, self.mesh.shard_size, self.plan)
        pass_list = bind_passes(self.stage_plan)
        layout = state_layout(pass_list, units, self.stage_plan)
        session = CompileSession(
            self.model, self.stage_plan, self.comm.world_size, self.loss_fn, self.mesh, full,
            None, held, pass_list, units, layout,
        )  # fmt: skip
        opened = open_context(self.stage_plan, self.comm, self.device, layout, SetupClock())
        self.context = opened.context
        dp = self.comm.on(DP_GROUP)
        first = next(g for g in self.mesh.groups(DP_GROUP) if self.comm.rank in g)[0]
        self.state = StateStore.allocate(
            self.model, session, self.comm, self.device, opened.nvme,
            broadcast=lambda t: dp.broadcast(t, first),
        )  # fmt: skip
        tied_units = frozenset(f"tied.{fqn}" for fqn in tied)
        counts_tied = all(self.pp_rank <= self.rank_of(s) for f in tied for s in staged.tied[f])
        lower = get_backend(resolve_backend(self.plan.backend.name, self.device))

        def compiled(graph: Any, boundary: bool, update_of: frozenset[str] | None = None):
            ctx = PassContext(
                self.stage_plan, self.comm.world_size, held, boundary, units=units,
                update_of=update_of, tied=tied_units, tied_norm=counts_tied,
            )  # fmt: skip
            gm, _ = run_passes(graph, ctx, pass_list)
            check_bindings(gm, layout, held)
            run = lower(gm, [val(n) for n in placeholders(gm)], self.context)
            return _Program(gm, bindings_of(gm), run)

        self.programs = {}
        reached: set[str] = set()
        for s in mine:
            stage = staged.stages[s]
            halves = dict(zip("IW", split_backward(stage.backward), strict=True))
            kinds = {"F": stage.forward, **(halves if self.schedule.splits_backward
                                            else {"B": stage.backward})}  # fmt: skip
            for kind, program in kinds.items():
                reached.update(program.writes("grad"))
                if not any(n.op == "call_function" for n in program.gm.graph.nodes):
                    self.programs[s, kind] = None  # (the first stage's input gradient)
                    continue
                graph = step_form(program, held)
                self.programs[s, kind] = compiled(graph, boundary=False)
        # A tied unit is reduced and updated on both ranks that hold it, whichever of them
        # computed its gradient (under mixed precision the cast's gradient sums both parts on
        # the first stage: the other's accumulator holds zeros).
        reached |= tied
        self.update = compiled(update_graph(held, self.device), True, frozenset(reached))
        self.transport = TorchTransport(
            staged, self.microbatches, lambda stage: self.pipeline_ranks[self.rank_of(stage)]
        )
        self.staged = staged


def _units(held: ModelInfo, tied: set[str], shard_size: int, plan: Plan) -> list[Unit]:
    """This rank's units as the plan groups its parameters, but a parameter another pipeline
    rank holds too: in a unit of its own, laid out alike on both (its gradient is summed
    between them)."""
    rest = ModelInfo(tuple(p for p in held.params if p.fqn not in tied), held.buffers,
                     held.modules)  # fmt: skip
    units = assign_units(rest, shard_size, plan.units.classes, plan.units.modules,
                         plan.units.min_mb)  # fmt: skip
    by_fqn = {p.fqn: p for p in held.params}
    return units + [Unit.build(f"tied.{fqn}", [by_fqn[fqn]], shard_size) for fqn in sorted(tied)]


def _check_supported(plan: Plan, device: torch.device) -> None:
    """NotSupportedError naming the field, for what a pipeline does not do yet."""
    backend = resolve_backend(plan.backend.name, device)
    unsupported = {
        "parallel.tp": plan.parallel.tp > 1,
        "offload": plan.offload.optimizer != "none" or plan.offload.params != "none",
        "precision.scaling (loss scaling)": plan.precision.scaling != "none",
        f"backend.name: {backend} (name eager)": backend != "eager",
    }
    asked = [name for name, used in unsupported.items() if used]
    if asked:
        raise NotSupportedError(
            f"pipeline parallelism (parallel.pp: {plan.parallel.pp}) does not yet combine with "
            f"{', '.join(asked)}; drop {'it' if len(asked) == 1 else 'them'}, or set "
            "parallel.pp: 1"
        )
