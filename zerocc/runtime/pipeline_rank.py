"""How a pipeline rank (``parallel.pp`` > 1, issue 47) runs its step: the strategy the one step
runner (:class:`zerocc.runtime.step.StepRunner`) calls where a data-parallel step runs one
program per micro-batch.

On the first call the step is captured on one micro-batch, split into stages and cut, and the
rank's programs compiled from the runner's session (:mod:`zerocc.compiler.driver.pipeline`);
its predicted memory is checked, its state allocated (by the runner) and its programs lowered.
Each call walks the rank's schedule of stage actions (:class:`zerocc.runtime.pipeline.
PipelineRank`) over the cut batch's micro-batches, then runs its one update; the loss is the
mean of the last stage's over the micro-batches, on every rank. Everything else a step is
(counters, the ranks' agreement and health, the step, learning-rate and loss-scale
accounting, checkpoints, the whole model on every rank) is the runner's, as for any step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from zerocc.backends import Executable, get_backend
from zerocc.compiler.capture import detach_inputs, traced_grad_mode
from zerocc.compiler.driver.pipeline import RankPrograms, capture_microbatch, compile_rank, cut_step
from zerocc.compiler.parallel.pipeline_schedule import (
    Action,
    PipelineSchedule,
    pipeline_schedule,
    schedules_over,
)
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import StagedStep
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.pipeline import less_gathered
from zerocc.compiler.state import StateLayout
from zerocc.cost.memory import model_state_bytes_of
from zerocc.cost.pipeline_memory import PipelineMemory, Programs, predict_pipeline_memory
from zerocc.cost.stage_balance import split_units
from zerocc.errors import BatchError, NotSupportedError
from zerocc.ir.keyed_draws import DrawKey, drawing_under
from zerocc.ir.nodes import BATCH, placeholders, val
from zerocc.ir.ops import DP_GROUP, PP_GROUP
from zerocc.runtime.agreement import has_peers
from zerocc.runtime.memory_check import check_pipeline_memory
from zerocc.runtime.nonfinite import nonfinite_units
from zerocc.runtime.pipeline import PipelineRank, StepTimeline, TorchTransport, microbatches_of
from zerocc.runtime.pipeline_state import held_earlier, whole_model
from zerocc.runtime.programs import bindings_of


@dataclass
class StageRun:
    """A compiled program of the rank, lowered: what its placeholders bind, and its run."""

    gm: fx.GraphModule
    bindings: list[tuple[str, str]]
    run: Executable


class PipelineWalk:
    """What is a pipeline rank's own in running a step: its schedule, its stage programs and
    update once the first batch has cut the step, the transport to its neighbours, the walk
    and its timeline, and the loss mean over micro-batches. ``runner`` is the step runner
    that calls it (its plan, ranks, state, counters, agreement and observer)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        plan, comm, mesh = runner.plan, runner.comm, runner.mesh
        pipeline, pp = plan.pipeline, plan.parallel.pp
        self.microbatches = pipeline.microbatches_of(pp)
        self.schedule = pipeline_schedule(
            pipeline.schedule, pp, self.microbatches, pipeline.stages_per_rank_of()
        )
        self.pp_rank = mesh.pp_rank(comm.rank)
        self.pipeline_ranks = next(g for g in mesh.groups(PP_GROUP) if comm.rank in g)
        self.opened = runner.session  # the whole model's session (the runner's becomes the rank's)
        self.staged: StagedStep | None = None  # built at the first call (a batch's shapes)
        self.signature: tuple = ()  # the first batch's, which the stages are compiled for
        self.programs: dict[tuple[int, str], StageRun | None] = {}
        self.update: StageRun | None = None
        # Evaluation's programs and their transport, by batch signature (built when asked).
        self._evaluations: dict[tuple, tuple[dict[int, StageRun], TorchTransport]] = {}
        # Its programs' and its update's predicted seconds, for the dumps (simulated once).
        self.predicted_seconds: tuple[dict[tuple[int, str], float], float] | None = None
        self.predicted_memory: PipelineMemory | None = None
        self.timeline = StepTimeline()  # what this rank did in the last step, and when

    @property
    def built(self) -> bool:
        """Whether the first batch has cut the step (the rank's state exists)."""
        return self.staged is not None

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (0 to pp - 1) that holds ``stage``."""
        return self.schedule.rank_of(stage)

    # -- a step -----------------------------------------------------------------------------

    def prepare(self, batch: tuple, signature: tuple) -> list[tuple]:
        """Agree on ``batch`` with the other ranks (its pipeline's on its contents), and cut it
        into the step's micro-batches; the first one cuts and compiles the step."""
        runner = self.runner
        runner.agreement.settle(runner._propose(("next batch", signature), batch))
        runner.comm.stats.reset()
        micro = microbatches_of(batch, self.microbatches)
        if self.staged is None:
            self._build(micro[0])
            self.signature = signature
        elif signature != self.signature:
            raise BatchError(
                f"a pipeline's stages are compiled for the batch of its first step "
                f"({_shapes(self.signature)}); step {runner.micro_batches + 1}'s is "
                f"{_shapes(signature)}: give every step batches of one shape (pad or drop the "
                "last, short one)"
            )
        return micro

    def walk(self, micro: list[tuple]) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """Run this rank's actions of the schedule on ``micro``, then its update: returns the
        step's mean loss (on every rank), whether its gradient was not finite on any rank
        (the update agreed it), and this rank's per-unit flags (None under loss scaling)."""
        runner = self.runner
        runners = {key: self._runner(program, micro) for key, program in self.programs.items()}
        rank = PipelineRank(runners, self.transport)
        timeline = self.timeline = StepTimeline(time.time())
        where = "its update"
        with traced_grad_mode(), runner._peers_named(lambda: where):
            start = time.perf_counter()
            for action in self.schedule.actions[self.pp_rank]:
                where = f"its action {action.stage}{action.kind}{action.microbatch}"
                began, waited = time.perf_counter() - start, rank.waited
                rank.run(action)
                end = time.perf_counter() - start
                timeline.actions.append((action, began, end, rank.waited - waited))
            where = "its sends"
            self.transport.finish()
            runner.context.payloads.check_taken()  # (every micro-batch's backward took its rows)
            began, where = time.perf_counter() - start, "its update"
            # (loss, found_inf) under loss scaling; (loss, per-unit flags, found_inf) without
            _, *flags, found_inf = self.update.run(*self._bound(self.update.bindings, ()))
            timeline.update = (began, time.perf_counter() - start)
        timeline.receives = [(a - start, b - start, stage) for a, b, stage in rank.receives]
        with runner._peers_named(lambda: "the step's loss"):
            loss = self._loss(rank.losses)
        return loss, bool(found_inf), flags[0] if flags else None  # (found_inf: any rank's)

    def nonfinite_units(self, flags: torch.Tensor) -> list[str]:
        """The units of the whole model whose gradient was not finite, on every rank of the
        pipeline: each rank's flags name its stages' units, so the ranks of a pipeline gather
        what theirs name (a collective: every rank calls it, after the same step)."""
        mine, comm = nonfinite_units(self.update.gm, flags), self.runner.comm
        if not has_peers(comm):  # (a FakeComm's ranks are simulated)
            return mine
        everyone = comm.all_gather_object(mine)
        return list(dict.fromkeys(unit for r in self.pipeline_ranks for unit in everyone[r]))

    def _runner(self, program: StageRun | None, micro: list[tuple]) -> Callable[[int], Any]:
        def run(microbatch: int) -> Any:
            if program is None:  # a program with nothing to do
                return None
            with self._keyed(microbatch):
                return program.run(*self._bound(program.bindings, micro[microbatch]))

        return run

    def _keyed(self, microbatch: int) -> contextlib.AbstractContextManager:
        """Under ``capture.draws: keyed``, the draw key of ``microbatch`` of the step about to
        run (an evaluation: the next one's), the global batch's ``data_rank * M + m``."""
        runner = self.runner
        if runner.plan.capture.draws != "keyed":
            return contextlib.nullcontext()
        place = runner.data_rank * self.microbatches + microbatch
        key = DrawKey(runner.plan.seed, runner.micro_batches, place)
        return drawing_under(key, runner.device)

    def _bound(self, bindings: list[tuple[str, str]], batch: tuple) -> list[Any]:
        state = self.runner.state
        return detach_inputs([batch[int(k)] if role == BATCH else state[k] for role, k in bindings])

    def _loss(self, losses: dict[int, Any]) -> torch.Tensor:
        """The mean loss of the step's micro-batches (the last stage's), on every rank: summed
        over the pipeline's ranks, where only the last stage's is not zero."""
        loss = torch.zeros((), dtype=torch.float32, device=self.runner.device)
        if losses:
            loss += torch.stack([losses[m].float() for m in sorted(losses)]).mean()
        self.runner.comm.on(PP_GROUP).all_reduce(loss).wait()
        return loss

    # -- the whole model, evaluation ----------------------------------------------------------

    def whole_state(self) -> dict[str, torch.Tensor]:
        """The whole model's ``{fqn: full tensor on CPU}`` on this rank: each stage's part
        gathered over its ranks and handed over the pipeline
        (:mod:`zerocc.runtime.pipeline_state`). A collective."""
        runner = self.runner
        with runner.comm.stats.paused():  # the last step's figures stay its own
            mine = runner.state.full_state_dict()
            return whole_model(runner.comm, runner.device, self.pipeline_ranks, mine,
                               runner.state.state_dict_keys)  # fmt: skip

    def evaluate(self, batch: tuple, signature: tuple) -> torch.Tensor:
        """The mean loss of ``batch`` (agreed on) under the current weights, forward only, on
        every rank of the pipeline: cut into as many micro-batches as the step's that divide
        it, which flow through the stages as GPipe's forwards do. Its programs (the step
        captured forward only in eval mode, cut where training's is, each stage's forward
        through the passes) are compiled on the first call of each batch signature."""
        if self.staged is None:
            raise NotSupportedError(
                "a pipeline evaluates after its first training step: its stages are cut on the "
                "first training batch"
            )
        sizes = [b.shape[0] for b in batch if isinstance(b, torch.Tensor) and b.dim() > 0]
        micro = microbatches_of(batch, math.gcd(self.microbatches, *sizes[:1]))
        programs, transport = self._evaluations.get(signature) or self._build_evaluation(
            signature, micro[0]
        )
        runners = {(s, "F"): self._runner(p, micro) for s, p in programs.items()}
        rank = PipelineRank(runners, transport)
        with traced_grad_mode(), self.runner._peers_named(lambda: "its evaluation"):
            for s in sorted(programs):  # what a stage receives comes from an earlier stage
                for m in range(len(micro)):
                    rank.run(Action("F", s, m))
            transport.finish()
            return self._loss(rank.losses)

    def _build_evaluation(
        self, signature: tuple, microbatch: tuple
    ) -> tuple[dict[int, StageRun], TorchTransport]:
        """This rank's evaluation programs for batches of ``signature``, and their transport."""
        runner = self.runner
        gm = capture_microbatch(
            runner.model, self.opened.model_splits, runner.plan, runner.loss_fn, microbatch,
            runner.device, gradients=False,
        )  # fmt: skip
        staged = cut_stages(gm, self.opened.model_splits.local, self.stage_units)
        mine = self.schedule.stages_of(self.pp_rank)
        programs = {
            s: self._lowered(gm) for s, gm in self.compiler.evaluation(staged, mine).items()
        }
        transport = self._transport(staged)
        self._evaluations[signature] = programs, transport
        return programs, transport

    # -- what it did --------------------------------------------------------------------------

    def counted_programs(self) -> list[tuple[fx.GraphModule, int]]:
        """This rank's stages' forwards, each with how many times a call runs it (once per
        micro-batch): the ranks' calls sum to the model's work."""
        return [(p.gm, self.microbatches) for (_, kind), p in self.programs.items()
                if kind == "F" and p is not None]  # fmt: skip

    def _walk_memory(
        self, schedule: PipelineSchedule, programs: Programs, layout: StateLayout
    ) -> PipelineMemory:
        states = model_state_bytes_of(layout)["total"]
        return predict_pipeline_memory(
            schedule.actions[self.pp_rank], programs, states, gloo=self.runner.comm.on_gloo
        )

    def _check_memory(self, compiled: RankPrograms) -> None:
        """Before anything is allocated: this rank's predicted peak fits its machine, or an
        error on every rank says by how much not, and which schedule would fit."""
        runner, layout = self.runner, compiled.session.layout
        others = {
            name: self._walk_memory(other, compiled.programs, layout)
            for name, other in schedules_over(self.schedule).items()
            if isinstance(other, PipelineSchedule) and name != self.schedule.name
            and other.runs_the_programs_of(self.schedule)
        }  # fmt: skip
        check_pipeline_memory(
            self.predicted_memory, others, self.schedule.stages_of(self.pp_rank), runner.comm,
            runner.device, less_gathered(runner.plan.zero.stage, runner.plan.pipeline.gather),
            model_state_bytes_of(layout).get("host", 0),
        )  # fmt: skip

    # -- building -----------------------------------------------------------------------------

    def _lowered(self, gm: fx.GraphModule) -> StageRun:
        """``gm`` lowered by the plan's backend onto the runner's context."""
        runner = self.runner
        lower = get_backend(runner.backend_name)
        run = lower(gm, [val(n) for n in placeholders(gm)], runner.context)
        return StageRun(gm, bindings_of(gm), run)

    def _transport(self, staged: StagedStep) -> TorchTransport:
        return TorchTransport(
            staged, self.microbatches, lambda stage: self.pipeline_ranks[self.rank_of(stage)],
            heartbeat=self.runner.comm.heartbeat,
        )  # fmt: skip

    def _build(self, microbatch: tuple) -> None:
        """Capture the step on ``microbatch``, cut it, compile this rank's programs (the
        observer told of each), check their memory, have the runner lay out and allocate the
        rank's state, and lower the programs."""
        runner, splits = self.runner, self.opened.model_splits
        runner.health.set_status(f"compiling a program for step {runner.counts.step_number}")
        gm = capture_microbatch(
            runner.model, splits, runner.plan, runner.loss_fn, microbatch, runner.device
        )
        stage_units, _ = split_units(runner.plan, gm, splits.local, runner.mesh.shard_size)
        staged = cut_step(gm, splits.local, stage_units, runner.plan, runner.mesh)
        compiled = compile_rank(
            self.opened, staged, self.schedule, self.pp_rank, runner.device,
            keep_graphs=runner.observer.keeps_pass_graphs,
        )  # fmt: skip
        for name, records in compiled.records.items():
            runner.observer.program_built(runner, name, records)
        # The programs stay as compiled: this rank's memory, walked once.
        self.predicted_memory = self._walk_memory(
            self.schedule, compiled.programs, compiled.session.layout
        )
        if runner.plan.backend.check_memory:
            self._check_memory(compiled)
        dp = runner.comm.on(DP_GROUP)
        first = next(g for g in runner.mesh.groups(DP_GROUP) if runner.comm.rank in g)[0]
        runner._open_state(compiled.session, broadcast=lambda t: dp.broadcast(t, first))
        self.programs = {key: self._lowered(gm) if gm is not None else None
                         for key, gm in compiled.programs.items()}  # fmt: skip
        self.update = self._lowered(compiled.update)
        self.stage_units, self.compiler = stage_units, compiled.compiler
        self.transport = self._transport(staged)
        runner.saved_elsewhere = held_earlier(
            staged, self.schedule, self.pp_rank, runner.full_model_info.buffers
        )
        self.staged = staged
        runner._resume()  # (a checkpoint loaded before the first call)


def _shapes(signature: tuple) -> str:
    """A batch signature as its tensors' shapes: ``[8, 16], [8, 16]``."""
    return ", ".join(str(list(part[1])) if part[0] == "tensor" else repr(part[1])
                     for part in signature)  # fmt: skip


def check_pipeline_supported(plan: Plan) -> None:
    """NotSupportedError naming the field, for what a pipeline does not do yet."""
    if plan.offload.defer_updates != "none":
        raise NotSupportedError(
            f"pipeline parallelism (parallel.pp: {plan.parallel.pp}) does not yet combine with "
            f"offload.defer_updates: {plan.offload.defer_updates}; set it to none (the host "
            "updates run at the end of the step), or set parallel.pp: 1"
        )
