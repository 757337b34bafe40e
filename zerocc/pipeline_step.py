"""A pipeline rank's training step (``parallel.pp`` > 1, issue 47): the step cut into stages,
the rank's stages compiled by the plan's passes, their actions walked, then one update.

On the first call the step is captured on one micro-batch, split into stages and cut, and the
rank's programs compiled from the session (:mod:`zerocc.compiler.driver.pipeline`); its state
is allocated and the programs lowered. Each call walks the rank's schedule
(:class:`zerocc.runtime.pipeline.PipelineRank`), then runs its one update; the loss is the
mean of the last stage's over the micro-batches, on every rank. The ranks agree, and a peer
that stops answering is named, as for a TrainStep (:mod:`zerocc.runtime.agreement`,
:mod:`zerocc.runtime.failures`). Checkpoints are a TrainStep's, by model name.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.distributed import DistError

from zerocc.backends import Executable, get_backend, resolve_backend
from zerocc.compiler.batch import batch_from
from zerocc.compiler.capture import LossFn, detach_inputs, traced_grad_mode
from zerocc.compiler.driver.pipeline import (
    RankPrograms,
    capture_microbatch,
    compile_rank,
    cut_step,
)
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.materialize import weight_source
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
from zerocc.compiler.schedule import lr_at
from zerocc.compiler.state import LOSS_SCALE_SPEC, LR_SPEC, STEP_SPEC, StateLayout
from zerocc.compiler.units import Unit
from zerocc.cost.memory import model_state_bytes_of
from zerocc.cost.pipeline_memory import PipelineMemory, Programs, predict_pipeline_memory
from zerocc.cost.stage_balance import split_units
from zerocc.engine.comm import Comm
from zerocc.engine.watchdog import PeersSilent
from zerocc.errors import BatchError, NotSupportedError
from zerocc.inspect import pipeline_report
from zerocc.inspect.dumps import dump_dir
from zerocc.inspect.pipeline_dumps import write_pipeline_programs, write_step_run
from zerocc.ir.keyed_draws import DrawKey, drawing_under
from zerocc.ir.nodes import BATCH, placeholders, val
from zerocc.ir.ops import DP_GROUP, PP_GROUP
from zerocc.runtime.agreement import END_OF_DATA, RankAgreement, has_peers
from zerocc.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zerocc.runtime.checkpoint.background import PendingSave, SavesInBackground
from zerocc.runtime.checkpoint.load import fill_state, open_checkpoint, restore_counters
from zerocc.runtime.checkpoint.rank_state import (
    load_rank_state_dict,
    rank_state_dict,
    restore_rank_counters,
)
from zerocc.runtime.context import open_context
from zerocc.runtime.counts import StepCounts
from zerocc.runtime.failures import RankHealth
from zerocc.runtime.loss_scale import LossScaler
from zerocc.runtime.memory_check import check_pipeline_memory
from zerocc.runtime.nonfinite import nonfinite_error
from zerocc.runtime.pipeline import PipelineRank, StepTimeline, TorchTransport, microbatches_of
from zerocc.runtime.pipeline_state import held_earlier, whole_model
from zerocc.runtime.programs import SetupClock, batch_signature, bindings_of
from zerocc.runtime.rank import to_device
from zerocc.runtime.state_store import StateStore, align_random_state


@dataclass
class _Program:
    """A compiled program of the rank, lowered: what its placeholders bind, and its run."""

    gm: fx.GraphModule
    bindings: list[tuple[str, str]]
    run: Executable


class PipelineStep(SavesInBackground):
    """One rank of a pipeline-parallel training step: ``step(*batch)`` trains on the rank's
    batch (the same on every rank of one pipeline), cut into ``pipeline.microbatches``, and
    returns the mean loss; ``full_state_dict()`` and ``materialize_model()`` give the whole
    model on every rank, and ``save``/``load`` checkpoint it, as :class:`zerocc.TrainStep`
    does."""

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        _check_supported(plan)
        self.model, self.plan, self.loss_fn, self.comm, self.device = (
            model, plan, loss_fn, comm, device
        )  # fmt: skip
        # The runtime's counters, health watch and agreement, as a TrainStep's (each call is
        # one optimizer step's batch, its micro-batches the pipeline's).
        self.counts = StepCounts(1)
        self.health = RankHealth(comm, plan.backend.timeout_s, self.counts)
        self.agreement = RankAgreement(self.health)
        if has_peers(comm):  # before any group is made or a weight sent
            self.agreement.agree_on_start(plan, weight_source(model), model)
        # The model converted (float8), described and split once, and the mesh, as any step's
        # session; each pipeline rank's units and programs once the first batch cuts the step.
        self.opened = CompileSession.open(model, plan, comm.world_size, loss_fn)
        self.mesh = self.opened.mesh
        comm.use_mesh(self.mesh)
        pipeline, pp = plan.pipeline, plan.parallel.pp
        self.microbatches = pipeline.microbatches_of(pp)
        self.schedule = pipeline_schedule(
            pipeline.schedule, pp, self.microbatches, pipeline.stages_per_rank_of()
        )
        self.pp_rank = self.mesh.pp_rank(comm.rank)
        self.pipeline_ranks = next(g for g in self.mesh.groups(PP_GROUP) if comm.rank in g)
        self.float8 = self.opened.float8
        if self.float8 is not None:
            self.float8.check_device(device)
        self.full_model_info = self.opened.full_model_info
        self.splits = self.opened.model_splits  # (layers, experts)
        self.staged: StagedStep | None = None  # built at the first call (a batch's shapes)
        self.signature: tuple = ()  # the first batch's, which the stages are compiled for
        self.dump_dir = dump_dir(plan)  # (zerocc.inspect.pipeline_dumps)
        # Evaluation's programs and their transport, by batch signature (built when asked).
        self._evaluations: dict[tuple, tuple[dict[int, _Program], TorchTransport]] = {}
        # fp16's loss scale: its counters from here (a checkpoint may load them before the
        # first call), its tensor the state's once that is allocated.
        self.loss_scaler: LossScaler | None = None
        if plan.precision.scaling != "none":
            scale = torch.zeros((), dtype=torch.float32, device=device)
            self.loss_scaler = LossScaler.of(plan.precision, scale)
        # Its programs' and its update's predicted seconds, for the dumps (simulated once).
        self.predicted_seconds: tuple[dict[tuple[int, str], float], float] | None = None
        # What an earlier pipeline rank holds too and saves (known once the step is cut).
        self.saved_elsewhere: frozenset[str] = frozenset()
        # A checkpoint loaded before the first call: read into the state once it exists.
        self._resume_from: Callable[[], None] | None = None
        self.timeline = StepTimeline()  # what this rank did in the last step, and when

    # -- the step ---------------------------------------------------------------------------

    def __call__(self, *batch: Any, **named: Any) -> torch.Tensor:
        """Train one step on this rank's ``batch`` (positional, by name or one mapping, as a
        TrainStep takes it); returns the mean loss of its micro-batches."""
        self.health.check_usable()
        batch = to_device(batch_from(batch, named), self.device)
        signature = batch_signature(batch)
        self.health.set_status(f"in step {self.counts.step_number}")
        self._agree_on(("next batch", signature), batch)
        self.comm.stats.reset()
        micro = microbatches_of(batch, self.microbatches)
        if self.staged is None:
            self._build(micro[0])
            self.signature = signature
        elif signature != self.signature:
            raise BatchError(
                f"a pipeline's stages are compiled for the batch of its first step "
                f"({_shapes(self.signature)}); step {self.micro_batches + 1}'s is "
                f"{_shapes(signature)}: give every step batches of one shape (pad or drop the "
                "last, short one)"
            )
        self.state[LR_SPEC.key].fill_(self.lr)
        if STEP_SPEC.key in self.state:
            self.state[STEP_SPEC.key].fill_(self.steps + 1)
        runners = {key: self._runner(program, micro) for key, program in self.programs.items()}
        rank = PipelineRank(runners, self.transport)
        timeline = self.timeline = StepTimeline(time.time())
        where = "its update"
        with traced_grad_mode(), self._peers_named(lambda: where):
            start = time.perf_counter()
            for action in self.schedule.actions[self.pp_rank]:
                where = f"its action {action.stage}{action.kind}{action.microbatch}"
                began, waited = time.perf_counter() - start, rank.waited
                rank.run(action)
                end = time.perf_counter() - start
                timeline.actions.append((action, began, end, rank.waited - waited))
            where = "its sends"
            self.transport.finish()
            self.context.payloads.check_taken()  # (every micro-batch's backward took its rows)
            began, where = time.perf_counter() - start, "its update"
            # (loss, found_inf) under loss scaling; (loss, per-unit flags, found_inf) without
            _, *flags, found_inf = self.update.run(*self._bound(self.update.bindings, ()))
            timeline.update = (began, time.perf_counter() - start)
        timeline.receives = [(a - start, b - start, stage) for a, b, stage in rank.receives]
        overflow = bool(found_inf)  # on any rank of any stage: the update agreed it
        if overflow:
            if STEP_SPEC.key in self.state:
                self.state[STEP_SPEC.key].fill_(self.steps)
            if self.plan.precision.nonfinite == "error":
                raise nonfinite_error(self.update.gm, flags[0], self.comm.rank, self.steps + 1)
        else:
            self.steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.micro_batches += 1
        with self._peers_named(lambda: "the step's loss"):
            loss = self._loss(rank.losses)
        self.health.set_status(f"after step {self.counts.step_number - 1}")
        if self.dump_dir is not None and self.micro_batches <= 2:
            write_step_run(self)
        return loss

    @contextlib.contextmanager
    def _peers_named(self, where: Callable[[], str]) -> Iterator[None]:
        """A collective or transfer of the body that fails is a peer that stopped answering:
        the RankStoppedError a TrainStep's run raises, naming it (``where()``: what this rank
        was running); the process group is unusable after it."""
        try:
            yield
        except BaseException as exc:  # (gloo's lost peer: a DistError, or a RuntimeError)
            peer = isinstance(exc, DistError | PeersSilent) or "Connection" in str(exc)
            if self.comm.failure is None and not peer:
                raise
            self.comm.failure = self.comm.failure or exc
            raise self.health.peer_failure(exc, where()) from exc

    def end_of_data(self) -> None:
        """Call instead of ``step(*batch)`` when this rank has no batch left: returns when every
        rank ran out at this step, else raises DataExhaustedError here and, in their call, on
        every rank that still had one (see :meth:`zerocc.TrainStep.end_of_data`)."""
        self.health.check_usable()
        self.health.set_status(f"out of data at step {self.counts.step_number}")
        self._agree_on(END_OF_DATA, None)

    def _agree_on(self, what: tuple, batch: tuple | None) -> None:
        """Every rank is about to train a batch of the same shapes (or none is, ``END_OF_DATA``),
        and the ranks of one pipeline on the same batch: an error on every rank, naming the
        ranks, when not (a rank out of data would otherwise leave its pipeline's neighbours
        waiting on a tensor it never sends, and a pipeline whose first and last stages read
        different batches trains a wrong model without any other error): the runtime's
        agreement (:class:`~zerocc.runtime.agreement.RankAgreement`), as a TrainStep's."""
        if has_peers(self.comm):  # (a FakeComm's ranks are simulated: none to agree with)
            proposed = self.agreement.propose(what, batch, self.data_rank, "pipeline")
            self.agreement.settle(proposed)

    @property
    def micro_batches(self) -> int:
        """Calls run (each one optimizer step's batch), skipped steps too."""
        return self.counts.micro_batches

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        self.counts.micro_batches = value

    @property
    def steps(self) -> int:
        """Optimizer steps applied (a step skipped for an overflow not counted)."""
        return self.counts.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.counts.steps = value

    @property
    def data_rank(self) -> int:
        """Which batch of each step this rank trains on (the ranks of a pipeline share it)."""
        return self.mesh.data_rank(self.comm.rank)

    @property
    def data_parallel(self) -> int:
        """How many batches one step trains on."""
        return self.mesh.data_parallel

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step runs with (None without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler else None

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return lr_at(self.plan.optimizer, self.steps)

    @property
    def units(self) -> list[Unit]:
        """This rank's units (its stages' parameters), from the first call on."""
        return self._built().units

    @property
    def layout(self) -> StateLayout:
        """The state this rank's programs bind, from the first call on."""
        return self._built().layout

    def _built(self) -> CompileSession:
        """The session of this rank's stages; CheckpointError before the first call."""
        if self.staged is None:
            raise CheckpointError(
                "a pipeline's stages are cut on its first batch: its state exists from the "
                "first call on (a checkpoint loads before it, and saves after it)"
            )
        return self.session

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (0 to pp - 1) that holds ``stage``."""
        return self.schedule.rank_of(stage)

    def _runner(self, program: _Program | None, micro: list[tuple]) -> Callable[[int], Any]:
        def run(microbatch: int) -> Any:
            if program is None:  # a program with nothing to do
                return None
            with self._keyed(microbatch):
                return program.run(*self._bound(program.bindings, micro[microbatch]))

        return run

    def _keyed(self, microbatch: int) -> contextlib.AbstractContextManager:
        """Under ``capture.draws: keyed``, the draw key of ``microbatch`` of the step about to
        run (an evaluation: the next one's), the global batch's ``data_rank * M + m``."""
        if self.plan.capture.draws != "keyed":
            return contextlib.nullcontext()
        place = self.data_rank * self.microbatches + microbatch
        return drawing_under(DrawKey(self.plan.seed, self.micro_batches, place), self.device)

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
        """``{fqn: full tensor on CPU}`` for every key of ``model.state_dict()``, as a
        TrainStep gives it: the whole model on every rank, each stage's part gathered over its
        ranks and handed over the pipeline (:mod:`zerocc.runtime.pipeline_state`). A
        collective: call it on every rank."""
        self._built()
        self.agreement.at_the_same_point("full_state_dict()", self.micro_batches)
        with self.comm.stats.paused():  # the last step's figures stay its own
            mine = self.state.full_state_dict()
            return whole_model(self.comm, self.device, self.pipeline_ranks, mine,
                               self.state.state_dict_keys)  # fmt: skip

    def materialize_model(self, device: str | torch.device = "cpu") -> nn.Module:
        """The model given to ``compile`` with the step's current weights and buffers, on
        ``device``: the whole model on every rank (see :meth:`zerocc.TrainStep.
        materialize_model`). A collective: call it on every rank."""
        return self.state.materialize_model(self.model, device, self.full_state_dict())

    def evaluate(self, *batch: Any, **named: Any) -> torch.Tensor:
        """The mean loss of this rank's ``batch`` (the same on every rank of one pipeline)
        under the current weights, forward only, on every rank of the pipeline; training goes
        on as if it had not run. The batch is cut into as many micro-batches as the step's
        that divide it, which flow through the stages as GPipe's forwards do. Its programs
        (the step captured forward only in eval mode, cut where training's is, each stage's
        forward through the passes) are compiled on the first call of each batch signature.
        Collective: every rank calls it together, after the first training step."""
        with self.comm.stats.paused():  # the last step's figures stay its own
            return self._evaluate(batch_from(batch, named))

    def _evaluate(self, batch: tuple) -> torch.Tensor:
        batch = to_device(batch, self.device)
        signature = batch_signature(batch)
        self._agree_on(("evaluation batch", signature), batch)
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
        with traced_grad_mode(), self._peers_named(lambda: "its evaluation"):
            for s in sorted(programs):  # what a stage receives comes from an earlier stage
                for m in range(len(micro)):
                    rank.run(Action("F", s, m))
            transport.finish()
            return self._loss(rank.losses)

    def _build_evaluation(
        self, signature: tuple, microbatch: tuple
    ) -> tuple[dict[int, _Program], TorchTransport]:
        """This rank's evaluation programs for batches of ``signature``, and their transport."""
        gm = capture_microbatch(
            self.model, self.splits, self.plan, self.loss_fn, microbatch, self.device,
            gradients=False,
        )  # fmt: skip
        staged = cut_stages(gm, self.splits.local, self.stage_units)
        mine = self.schedule.stages_of(self.pp_rank)
        programs = {
            s: self._lowered(gm) for s, gm in self.compiler.evaluation(staged, mine).items()
        }
        transport = TorchTransport(
            staged, self.microbatches, lambda stage: self.pipeline_ranks[self.rank_of(stage)],
            heartbeat=self.comm.heartbeat,
        )  # fmt: skip
        self._evaluations[signature] = programs, transport
        return programs, transport

    # -- what it did ------------------------------------------------------------------------

    def predicted_peak_bytes(self) -> int:
        """This rank's predicted device peak over its schedule (:meth:`memory`'s), as
        :meth:`zerocc.TrainStep.predicted_peak_bytes` gives a step's: what ``zerocc train``
        reports to its launcher."""
        return self.memory().peak

    def counted_programs(self) -> list[tuple[fx.GraphModule, int]]:
        """The programs whose model FLOPs one call counts, each with how many times a call runs
        it: this rank's stages' forwards, once per micro-batch (the ranks' calls sum to the
        model's work)."""
        return [(p.gm, self.microbatches) for (_, kind), p in self.programs.items()
                if kind == "F" and p is not None]  # fmt: skip

    def memory(self) -> PipelineMemory:
        """This rank's predicted device peak: its model states, what its stages keep for
        backward over the schedule's micro-batches in flight, and the running program's
        transients (:mod:`zerocc.cost.pipeline_memory`)."""
        self._built()
        return self.predicted_memory

    def _walk(
        self, schedule: PipelineSchedule, programs: Programs, layout: StateLayout
    ) -> PipelineMemory:
        states = model_state_bytes_of(layout)["total"]
        return predict_pipeline_memory(
            schedule.actions[self.pp_rank], programs, states, gloo=self.comm.on_gloo
        )

    def _check_memory(self, compiled: RankPrograms) -> None:
        """Before anything is allocated: this rank's predicted peak fits its machine, or an
        error on every rank says by how much not, and which schedule would fit."""
        layout = compiled.session.layout
        others = {
            name: self._walk(other, compiled.programs, layout)
            for name, other in schedules_over(self.schedule).items()
            if isinstance(other, PipelineSchedule) and name != self.schedule.name
            and other.runs_the_programs_of(self.schedule)
        }  # fmt: skip
        check_pipeline_memory(
            self.predicted_memory, others, self.schedule.stages_of(self.pp_rank), self.comm,
            self.device, less_gathered(self.plan.zero.stage, self.plan.pipeline.gather),
            model_state_bytes_of(layout).get("host", 0),
        )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """Figures of the last step, as :meth:`zerocc.TrainStep.summary` gives them, and the
        pipeline's own (:func:`zerocc.inspect.pipeline_report.summary`)."""
        self._built()
        return pipeline_report.summary(self)

    def explain(self) -> str:
        """What this pipeline rank runs: the cut, its schedule with the predicted bubble, the
        last step's measured waiting, and its predicted memory."""
        self._built()
        return pipeline_report.explain(self)

    def backend_notes(self) -> dict[str, list[str]]:
        """What the backend made of each of this rank's programs, by program name (``rank0-
        stage1-F``, ``rank0-update``): compiled whole or by region, and why."""
        self._built()
        return pipeline_report.backend_notes(self)

    def _lowered(self, gm: fx.GraphModule) -> _Program:
        """``gm`` lowered by the plan's backend onto this rank's context."""
        lower = get_backend(resolve_backend(self.plan.backend.name, self.device))
        return _Program(gm, bindings_of(gm), lower(gm, [val(n) for n in placeholders(gm)],
                                                   self.context))  # fmt: skip

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, folder: str | Path, keep: int | None = None) -> Path:
        """Save a checkpoint under ``folder`` (``step-<n>``) that loads under any pipeline,
        world size, stage or units (see :meth:`zerocc.TrainStep.save`); every rank writes
        what its stages hold. Call on every rank, after a step."""
        self._built()
        self.wait_for_save()
        return save_checkpoint(self, folder, keep)

    def save_async(self, folder: str | Path, keep: int | None = None) -> PendingSave:
        """Save in the background (see :meth:`zerocc.TrainStep.save_async`)."""
        self._built()
        return super().save_async(folder, keep)

    def load(self, path: str | Path) -> list[str]:
        """Load a checkpoint saved under any mesh (see :meth:`zerocc.TrainStep.load`); returns
        notes on what differs from the run that saved it. Before the first call, the
        checkpoint is found and checked now (the counters set) and its tensors read once the
        first batch has cut the stages. Call on every rank."""
        self.wait_for_save()
        if self.staged is not None:
            _, notes = load_checkpoint(self, path)
            return notes
        folder, manifest = open_checkpoint(self, path)
        self._resume_from = lambda: fill_state(self, folder, manifest)
        return restore_counters(self, manifest.meta)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards, optimizer state and counters for ``torch.distributed.checkpoint``
        (see :meth:`zerocc.TrainStep.state_dict`): reloads under the same plan and world."""
        self._built()
        return rank_state_dict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave; before the first call, the counters now and
        the tensors once the first batch has cut the stages (as :meth:`load`)."""
        if self.staged is not None:
            load_rank_state_dict(self, sd)
            return
        restore_rank_counters(self, sd)
        self._resume_from = lambda: self.state.load_state_dict(sd)

    def apply_carried_update(self) -> None:
        """(A pipeline defers no update: offload is refused.)"""

    # -- building ---------------------------------------------------------------------------

    def _build(self, microbatch: tuple) -> None:
        """Capture the step on ``microbatch``, cut it, compile this rank's programs, lay out and
        allocate its state and lower the programs."""
        local = self.splits.local
        gm = capture_microbatch(
            self.model, self.splits, self.plan, self.loss_fn, microbatch, self.device
        )
        stage_units, _ = split_units(self.plan, gm, local, self.mesh.shard_size)
        staged = cut_step(gm, local, stage_units, self.plan, self.mesh)
        dumps = self.dump_dir is not None
        compiled = compile_rank(
            self.opened, staged, self.schedule, self.pp_rank, self.device, keep_graphs=dumps
        )
        if dumps and self.comm.rank % self.mesh.stage_ranks == 0:  # the pipeline rank's first
            write_pipeline_programs(self.dump_dir, compiled.records)
        # The programs stay as compiled: this rank's memory, walked once.
        programs, layout = compiled.programs, compiled.session.layout
        self.predicted_memory = self._walk(self.schedule, programs, layout)
        if self.plan.backend.check_memory:
            self._check_memory(compiled)
        self.session = session = compiled.session
        opened = open_context(session.plan, self.comm, self.device, session.layout, SetupClock())
        self.context = opened.context
        dp = self.comm.on(DP_GROUP)
        first = next(g for g in self.mesh.groups(DP_GROUP) if self.comm.rank in g)[0]
        self.state = StateStore.allocate(
            self.model, session, self.comm, self.device, opened.nvme,
            broadcast=lambda t: dp.broadcast(t, first),
        )  # fmt: skip
        if self.mesh.tp > 1:
            align_random_state(self.comm, session, self.device)
        if self.loss_scaler is not None:  # the programs read the scale from the state
            self.loss_scaler.tensor = self.state[LOSS_SCALE_SPEC.key]
            self.loss_scaler.tensor.fill_(self.loss_scaler.scale)
        self.programs = {key: self._lowered(gm) if gm is not None else None
                         for key, gm in compiled.programs.items()}  # fmt: skip
        self.update = self._lowered(compiled.update)
        self.stage_units, self.compiler = stage_units, compiled.compiler
        self.transport = TorchTransport(
            staged, self.microbatches, lambda stage: self.pipeline_ranks[self.rank_of(stage)],
            heartbeat=self.comm.heartbeat,
        )  # fmt: skip
        self.saved_elsewhere = held_earlier(
            staged, self.schedule, self.pp_rank, self.full_model_info.buffers
        )
        self.staged = staged
        if self._resume_from is not None:
            self._resume_from()
            self._resume_from = None


def _shapes(signature: tuple) -> str:
    """A batch signature as its tensors' shapes: ``[8, 16], [8, 16]``."""
    return ", ".join(str(list(part[1])) if part[0] == "tensor" else repr(part[1])
                     for part in signature)  # fmt: skip


def _check_supported(plan: Plan) -> None:
    """NotSupportedError naming the field, for what a pipeline does not do yet."""
    if plan.offload.defer_updates != "none":
        raise NotSupportedError(
            f"pipeline parallelism (parallel.pp: {plan.parallel.pp}) does not yet combine with "
            f"offload.defer_updates: {plan.offload.defer_updates}; set it to none (the host "
            "updates run at the end of the step), or set parallel.pp: 1"
        )
