"""StepRunner: the step loop of a rank: build a program for each batch signature, run it,
account the step.

``step(*batch)`` runs one micro-batch on this rank: forward, backward, communication and, on
every ``grad_accumulation``-th call, the optimizer update. Programs are built on first sight
of a batch signature (shapes, dtypes, non-tensor values) and cached, one for micro-batches that
step and one for those that only accumulate. On each call the ranks agree on the signature (a
mismatch is an error on every rank, never a hang): the agreement is issued at once and settled
before this rank compiles, or, for a cached program, right before its first collective, so that
its round trip runs behind the work before it (see :mod:`zerocc.runtime.agreement`). Before a new
program first runs the ranks compare its hash (a mismatch names the first differing line).

What the loop stands on has a module each: the compile session
(:mod:`zerocc.compiler.driver.session`), the programs built from it
(:mod:`zerocc.runtime.programs`), what they run on (:mod:`zerocc.runtime.context`), the state
they bind (:mod:`zerocc.runtime.state_store`), the ranks' agreement
(:mod:`zerocc.runtime.agreement`), what failures become (:mod:`zerocc.runtime.failures`) and the
update a step carries into the next (:mod:`zerocc.runtime.carried`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import DistError

from zerocc.backends import resolve_backend
from zerocc.compiler.batch import batch_from
from zerocc.compiler.capture import LossFn, ModelInfo, detach_inputs, traced_grad_mode
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.materialize import weight_source
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan import Plan
from zerocc.compiler.schedule import lr_at
from zerocc.compiler.state import LOSS_SCALE_SPEC, LR_SPEC, STEP_SPEC, StateLayout
from zerocc.compiler.units import Unit
from zerocc.engine.comm import Comm
from zerocc.engine.failures import describe_node, failing_node
from zerocc.engine.transfers import TransferStats
from zerocc.engine.watchdog import PeersSilent
from zerocc.errors import CheckpointError, NotSupportedError
from zerocc.ir.keyed_draws import DrawKey, drawing_under
from zerocc.ir.nodes import BATCH
from zerocc.runtime.agreement import END_OF_DATA, Agreement, RankAgreement, has_peers
from zerocc.runtime.carried import CarriedUpdate
from zerocc.runtime.context import open_context
from zerocc.runtime.counts import StepCounts
from zerocc.runtime.failures import RankHealth, run_failure
from zerocc.runtime.loss_scale import LossScaler
from zerocc.runtime.measure import ProfiledRun, RecorderFactory
from zerocc.runtime.memory_check import check_model_states
from zerocc.runtime.nonfinite import nonfinite_error, nonfinite_units
from zerocc.runtime.pipeline_rank import PipelineWalk, check_pipeline_supported
from zerocc.runtime.programs import LoweredProgram, ProgramBuilder, SetupClock, batch_signature
from zerocc.runtime.rank import to_device
from zerocc.runtime.state_store import StateStore, align_random_state
from zerocc.runtime.step_inspection import StepInspection


class StepObserver:
    """What watches a step runner from a layer above it (:class:`zerocc.TrainStep` attaches
    the dumps): told of each program compiled, and handed each micro-batch to run. This base
    observes nothing and runs each micro-batch as the runner would."""

    # Whether compiled programs keep the graph after each pass (memory and time that only
    # inspection needs).
    keeps_pass_graphs = False

    def program_built(self, runner: StepRunner, name: str, records: list[PassRecord]) -> None:
        """A program (``step-N`` / ``accumulate-N`` / ``evaluate-N``) has been compiled;
        ``records``: what each pass did."""

    def run_step(
        self, runner: StepRunner, batch: tuple, step: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """Run one micro-batch of ``runner`` on ``batch``; ``step()`` runs it as the runner
        does. Returns its loss."""
        return step()


class StepRunner(StepInspection):
    """Runs the compiled training step of one rank, holding what it stands on: its compile
    session, the programs built (``programs``, by batch signature), the state they bind
    (``state``, a :class:`~zerocc.runtime.state_store.StateStore`), the agreement with the
    other ranks and the step counters: the runtime under :class:`zerocc.TrainStep`, which adds
    what users read about it."""

    observer: StepObserver = StepObserver()  # observes nothing (zerocc.TrainStep sets its own)
    # What a checkpoint of this rank leaves to another rank's writing: nothing (a pipeline
    # rank's tied embedding, say, is an earlier pipeline rank's to write).
    saved_elsewhere: frozenset[str] = frozenset()

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        if plan.parallel.pp > 1:
            check_pipeline_supported(plan)
        self.plan, self.loss_fn, self.comm, self.device = plan, loss_fn, comm, device
        self.model = model
        self.counts = StepCounts(plan.grad_accumulation)
        self.health = RankHealth(comm, plan.backend.timeout_s, self.counts)
        self.agreement = RankAgreement(self.health)
        source = weight_source(model)
        if has_peers(comm):  # before any group is made or weight read
            self.agreement.agree_on_start(plan, source, model)
        # What every program shares, worked out once as zerocc inspect does (the mesh, the
        # model described, under tensor parallelism as this rank's slices, the passes, the
        # units and the state they declare): the state is laid out in units before any
        # program exists (a checkpoint loads into it before the first call), and a plan that
        # cannot partition this model (a pattern that matches nothing) is an error here.
        self.session = CompileSession.open(model, plan, comm.world_size, loss_fn)
        if self.session.float8 is not None:  # a GPU without float8 matmuls: a clear error
            self.session.float8.check_device(device)
        # The ranks' layout (:class:`~zerocc.compiler.parallel.mesh.Mesh`): units are sharded
        # over the `dp` group (every rank, or a shard group under hybrid sharding, tensor or
        # pipeline parallelism, made here: a collective).
        self.mesh: Mesh = self.session.mesh
        # Every parameter and buffer of the model, whole (under tensor parallelism too).
        self.full_model_info: ModelInfo = self.session.full_model_info
        comm.use_mesh(self.mesh)
        self.backend_name = resolve_backend(plan.backend.name, device)
        self.setup = SetupClock()
        self.initial_weights = None if source is None else source.describe()
        # fp16's loss scale: its counters from here (a checkpoint may load them before a
        # pipeline's first call), its tensor the state's once that is allocated.
        self.loss_scaler: LossScaler | None = None
        if plan.precision.scaling != "none":
            scale = torch.zeros((), dtype=torch.float32, device=device)
            self.loss_scaler = LossScaler.of(plan.precision, scale)
        self.programs: dict[tuple, LoweredProgram] = {}
        self._last_program: LoweredProgram | None = None
        # A checkpoint loaded before a pipeline's first call: read once its state exists.
        self._resume_from: Callable[[], None] | None = None
        # How a step runs: one program per micro-batch (None), or a pipeline rank's walk of
        # its schedule of stage actions, then its update, per step; the pipeline's stages are
        # cut, and its state allocated, at its first call (a batch's shapes).
        self.pipeline = PipelineWalk(self) if plan.parallel.pp > 1 else None
        if self.pipeline is None:
            self._open_state(self.session)

    def _open_state(
        self, session: CompileSession, broadcast: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """Open what the programs of ``session`` (the runner's, or a pipeline rank's) run on
        and allocate the state they bind; ``broadcast`` sends rank 0's weights (default: over
        every rank; a pipeline's, over its stage's ranks). The TrainStep owns the weights from
        here (``full_state_dict()`` returns them)."""
        plan, comm, device = self.plan, self.comm, self.device
        self.session = session
        opened = open_context(plan, comm, device, session.layout, self.setup)
        self.context, self.transfers = opened.context, opened.context.transfers
        self.kernels, self.host_kernels = opened.kernels, opened.host_kernels
        if plan.backend.check_memory and self.pipeline is None:  # (a pipeline's: its schedule's)
            check_model_states(session.model_info, session.units, session.layout, plan, comm,
                               device)  # fmt: skip
        with self.setup.timed("model states"):
            self.state = StateStore.allocate(
                self.model, session, comm, device, opened.nvme, broadcast=broadcast
            )
        if self.mesh.tp > 1:
            align_random_state(comm, session, device)
        if self.loss_scaler is not None:  # the programs read the scale from the state
            self.loss_scaler.tensor = self.state[LOSS_SCALE_SPEC.key]
            self.loss_scaler.tensor.fill_(self.loss_scaler.scale)
        self.builder = ProgramBuilder(
            session, self.context, self.agreement, self.setup, self.backend_name
        )
        self.carried = CarriedUpdate(self.state, self.context)  # (offload.defer_updates)

    def _resume(self) -> None:
        """Read a checkpoint loaded before the state existed (a pipeline's first call)."""
        if self._resume_from is not None:
            resume, self._resume_from = self._resume_from, None
            resume()

    def _built(self) -> CompileSession:
        """The session of this rank's programs; CheckpointError before a pipeline's first
        call (its stages, and so its state, are cut on its first batch)."""
        if self.pipeline is not None and not self.pipeline.built:
            raise CheckpointError(
                "a pipeline's stages are cut on its first batch: its state exists from the "
                "first call on (a checkpoint loads before it, and saves after it)"
            )
        return self.session

    @property
    def micro_batches(self) -> int:
        """Micro-batches run (a resumed checkpoint's included)."""
        return self.counts.micro_batches

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        self.counts.micro_batches = value

    @property
    def steps(self) -> int:
        """Optimizer steps applied (steps skipped for a non-finite gradient not counted)."""
        return self.counts.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.counts.steps = value

    @property
    def setup_seconds(self) -> dict[str, float]:
        """Where the time before training went, by phase (:class:`SetupClock`)."""
        return self.setup.seconds

    @property
    def units(self) -> list[Unit]:
        """The FSDP units every program is compiled for (a pipeline rank's: its stages')."""
        return self._built().units

    @property
    def layout(self) -> StateLayout:
        """The state every program binds, as the plan's passes declare it."""
        return self._built().layout

    @property
    def data_rank(self) -> int:
        """Which batch of each step this rank trains on: its rank, unless tensor or pipeline
        parallelism groups ranks (the ranks of a tp group, or of a pipeline, must be given the
        same batch)."""
        return self.mesh.data_rank(self.comm.rank)

    @property
    def data_parallel(self) -> int:
        """How many batches one step trains on: the world size, unless tensor parallelism
        groups ranks."""
        return self.mesh.data_parallel

    # -- the step loop ----------------------------------------------------------------------

    def __call__(self, *batch: Any, **named: Any) -> torch.Tensor:
        """Run one micro-batch of this rank; returns its loss. The batch is the model's
        arguments: positional, by name (``step(input_ids=ids, labels=ids)``) or one mapping
        of them (``step(batch)``), see :mod:`zerocc.compiler.batch`."""
        batch = batch_from(batch, named)
        return self.observer.run_step(self, batch, lambda: self._step(batch))

    def profile(
        self,
        *batch: Any,
        recorder: RecorderFactory = ProfiledRun,
        comm: Comm | None = None,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, ProfiledRun]:
        """Run one micro-batch as :meth:`__call__` does, op by op, timing every op and
        measuring live tensor memory (see :class:`zerocc.runtime.measure.ProfiledRun`): the
        program's executable (as the plan's backend lowered it) is interpreted.
        ``recorder`` makes the ProfiledRun (subclass) that runs it (``zerocc.inspect.calibrate``
        has its own); ``comm``: the process group its collectives run on (default: the
        step's; calibration times each collective alone on a wrapper of it); ``backend``: the
        backend to lower it with instead of the plan's (calibration times every op under
        ``eager``: a compiled region is one call, whose ops it cannot time). Given either, the
        program is lowered again, bound to ``comm``, once: later profiles there reuse it.
        A pipeline rank runs a schedule of stage programs: NotSupportedError (its dumps draw
        each step's actions and bubbles instead)."""
        if self.pipeline is not None:
            raise NotSupportedError(
                "profile() runs one program op by op; a pipeline rank (parallel.pp > 1) runs a "
                "schedule of stage programs: profile with parallel.pp: 1, or set dumps.dir "
                "(ZEROCC_DUMP_DIR) for the pipeline's measured trace"
            )
        recorders: list[ProfiledRun] = []

        def recorded(program: LoweredProgram) -> ProfiledRun:
            executable = program.run
            if comm is not None or backend is not None:
                on = comm if comm is not None else self.comm
                executable = self.builder.lowered_on(program, on, backend)
            states = self.model_state_bytes()
            recorders.append(recorder(executable, self.comm.rank, states, program=program.gm))
            return recorders[-1]

        loss = self._step(batch, recorded)
        return loss, recorders[0]

    def _step(
        self, batch: tuple, recorded: Callable[[LoweredProgram], ProfiledRun] | None = None
    ) -> torch.Tensor:
        """One micro-batch (a pipeline's: one step's batch); ``recorded(program)``, when given,
        makes the recorder the program runs under (on an executable of its own) instead of
        the program's executable."""
        self.health.check_usable()
        batch = self._on_device(batch)
        boundary = self.updates_next
        signature = batch_signature(batch)
        self.health.set_status(f"in step {self.counts.step_number}")
        if self.pipeline is not None:  # a schedule of stage actions, then the one update
            micro = self.pipeline.prepare(batch, signature)
            self._set_step_inputs()
            loss, overflow, flags = self.pipeline.walk(micro)
        else:  # one program per micro-batch
            loss, overflow, flags = self._program_step(batch, signature, boundary, recorded)
        self.micro_batches += 1
        if boundary:
            self._account_step(overflow, flags)
            self.health.set_status(f"after step {self.counts.step_number - 1}")
        return loss

    def _program_step(
        self,
        batch: tuple,
        signature: tuple,
        boundary: bool,
        recorded: Callable[[LoweredProgram], ProfiledRun] | None,
    ) -> tuple[Any, bool, torch.Tensor | None]:
        """Run the program of ``batch``'s signature (built on its first sight): returns its
        loss, whether its gradient was not finite (then the step wrote nothing) and its
        per-unit flags (None where it returns none)."""
        key = (signature, boundary)
        agreement = self._propose(("next batch", signature, boundary), batch)
        program = self.programs.get(key)
        first_run = program is None
        if program is None:  # kept once it has run: a program that fails is not
            self.agreement.settle(agreement)  # every rank compiles it, or none does
            program = self._build(batch, boundary)
        elif not program.agrees_at_first_collective or program.carries:
            self.agreement.settle(agreement)  # (a carried update runs before the first collective)
        if boundary:
            self._set_step_inputs()
        if program.carries:
            self.carried.set_inputs()
        recorder = recorded(program) if recorded is not None else None
        new_signature = signature if first_run else None
        loss = self._run(program, batch, agreement, boundary, new_signature, recorder)
        if first_run:
            self.programs[key] = program
        if (recorder.executable if recorder is not None else program.run).in_flight():
            raise RuntimeError("a program finished with collectives still in flight")
        self.context.payloads.check_taken()
        self._last_program = program
        overflow, flags = False, None
        if program.returns_found_inf:
            # (loss, found_inf) under loss scaling; (loss, per-unit flags, found_inf) without.
            loss, *flags, found_inf = loss
            overflow, flags = bool(found_inf), flags[0] if flags else None
        if program.carries:  # this step's update runs at the start of the next program
            self.carried.pending = None if overflow else (self.steps + 1, self.lr)
        return loss, overflow, flags

    @contextlib.contextmanager
    def _peers_named(self, where: Callable[[], str]) -> Iterator[None]:
        """A collective or transfer of the body that fails is a peer that stopped answering:
        the RankStoppedError naming it (``where()``: what this rank was running); the process
        group is unusable after it. (A program's run says the op: :func:`run_failure`.)"""
        try:
            yield
        except BaseException as exc:  # (gloo's lost peer: a DistError, or a RuntimeError)
            peer = isinstance(exc, DistError | PeersSilent) or "Connection" in str(exc)
            if self.comm.failure is None and not peer:
                raise
            self.comm.failure = self.comm.failure or exc
            raise self.health.peer_failure(exc, where()) from exc

    def _run(
        self,
        program: LoweredProgram,
        batch: tuple,
        agreement: Agreement,
        boundary: bool,
        new_signature: tuple | None,
        recorder: ProfiledRun | None,
    ) -> Any:
        """Run ``program`` on ``batch`` (under ``recorder``, when given), settling the ranks'
        ``agreement`` on it no later than right before its first collective; ``new_signature``:
        the batch signature it was just built for (None for a cached program). A run that
        raises raises what :func:`~zerocc.runtime.failures.run_failure` makes of it."""
        executable = recorder.executable if recorder is not None else program.run
        late = None if agreement.settled else lambda: self.agreement.settle(agreement)
        first_run = new_signature is not None
        self.comm.stats.reset()
        self.transfers.stats.reset()
        try:
            with (
                traced_grad_mode(),  # some kernels' outputs depend on it (an LSTM's, on CPU)
                self._keyed(),
                self.comm.checked_before_first_collective(late),
                self.setup.timed("first run") if first_run else contextlib.nullcontext(),
            ):
                args = self._bound(program, batch)  # (detached: grad mode records no graph)
                loss = recorder.run(*args) if recorder is not None else executable(*args)
                if first_run and self.device.type == "cuda":  # its kernels' time, not launches'
                    torch.cuda.synchronize(self.device)
        except BaseException as exc:
            executable.reset()
            if program.carries:  # applied in part, perhaps: never again
                self.carried.pending = None
            if exc is agreement.error:  # the ranks disagree: stopped before anything was written
                if boundary and STEP_SPEC.key in self.state:
                    self.state[STEP_SPEC.key].fill_(self.steps)
                raise
            if not agreement.settled:  # the peers settle it: so must this rank, then fail
                with contextlib.suppress(Exception):
                    self.agreement.settle(agreement)
            failure = run_failure(
                exc,
                program.run.gm,
                self.health,
                applied_steps=self.steps,
                drop_window=self._drop_window,
                new_signature=new_signature,
                earlier=[sig for sig, _ in self.programs],
            )
            if failure is exc:
                raise
            raise failure from exc
        if not agreement.settled:  # (settled before the run, or at its first collective)
            self.agreement.settle(agreement)
        return loss

    def _keyed(self) -> contextlib.AbstractContextManager:
        """Under ``capture.draws: keyed``, the draw key of the micro-batch about to run (an
        evaluation: the next one's): micro-batch ``m`` of ``M`` a rank runs per step is the
        global batch's ``data_rank * M + m``."""
        if self.plan.capture.draws != "keyed":
            return contextlib.nullcontext()
        per_rank, run = self.counts.grad_accumulation, self.counts.micro_batches
        key = DrawKey(self.plan.seed, run // per_rank, self.data_rank * per_rank + run % per_rank)
        return drawing_under(key, self.device)

    def _on_device(self, batch: tuple) -> tuple:
        """``batch`` with its tensors on the step's device."""
        return to_device(batch, self.device)

    def _bound(self, program: LoweredProgram, batch: tuple) -> list[Any]:
        """What ``program``'s placeholders bind, in order: ``batch``'s values and the state,
        detached (so that grad mode records no autograd graph)."""
        bound = [batch[int(k)] if role == BATCH else self.state[k] for role, k in program.bindings]
        return detach_inputs(bound)

    def _propose(self, what: tuple, batch: tuple | None = None) -> Agreement:
        """Issue the ranks' agreement on the next micro-batch (see
        :meth:`~zerocc.runtime.agreement.RankAgreement.propose`): under tensor parallelism on
        the batch's contents too, within this rank's tp group (a pipeline's: within its
        pipeline)."""
        if self.pipeline is not None:
            return self.agreement.propose(what, batch, self.data_rank, "pipeline")
        tp_group = self.data_rank if self.mesh.tp > 1 else None
        return self.agreement.propose(what, batch, tp_group)

    def _build(self, batch: tuple, boundary: bool, training: bool = True) -> LoweredProgram:
        """Build the program of ``batch`` (see :class:`~zerocc.runtime.programs.ProgramBuilder`),
        the observer told of it once its passes ran."""
        self.health.set_status(f"compiling a program for step {self.counts.step_number}")
        kind = "step" if boundary else "accumulate" if training else "evaluate"
        name = f"{kind}-{len(self.programs)}"
        keep = self.observer.keeps_pass_graphs
        return self.builder.build(
            batch,
            boundary,
            training,
            keep,
            lambda records: self.observer.program_built(self, name, records),
        )

    def evaluate(self, *batch: Any, **named: Any) -> torch.Tensor:
        """The loss of one micro-batch of this rank under the current weights, forward only:
        a program of its own (compiled on the first call of each batch signature, with the
        model in eval mode) gathers what forward needs and changes no state; training goes
        on as if it had not run. Collective: every rank calls it together (the ranks agree on
        the batch first). The batch is given as to a step's call (a pipeline's: one step's
        batch, see :meth:`~zerocc.runtime.pipeline_rank.PipelineWalk.evaluate`)."""
        self.health.check_usable()
        batch = self._on_device(batch_from(batch, named))
        signature = batch_signature(batch)
        key = (signature, "evaluate")
        self.health.set_status(f"evaluating after step {self.counts.step_number - 1}")
        if self.pipeline is not None:
            with self.comm.stats.paused():  # the last step's figures stay its own
                self.agreement.settle(self._propose(("evaluation batch", signature), batch))
                return self.pipeline.evaluate(batch, signature)
        self.agreement.settle(self._propose(("evaluation batch", signature), batch))
        self.apply_carried_update()  # (after the agreement: under stages 1-2 it all-gathers)
        program = self.programs.get(key) or self._build(batch, boundary=False, training=False)
        try:
            with traced_grad_mode(), self._keyed(), self._stats_kept():
                loss = program.run(*self._bound(program, batch))
            self.context.payloads.check_taken()
        except BaseException as exc:
            program.run.reset()
            if self.comm.failure is not None:
                node = failing_node(program.run.gm, exc.__traceback__)
                raise self.health.peer_failure(exc, describe_node(node)) from exc
            raise
        self.programs[key] = program
        return loss

    def apply_carried_update(self) -> None:
        """Apply the update an offload deferred out of the last step now (nothing to do
        when none is pending): before anything reads the weights or the optimizer states.
        Under stages 1-2 on more than one rank it all-gathers the updated shards, so every rank
        calls it together (its callers are collective: a save or load, an evaluation,
        full_state_dict). (A pipeline defers no update: offload.defer_updates is refused.)"""
        if self.pipeline is None:
            self.carried.apply(self.programs.values())

    @contextlib.contextmanager
    def _stats_kept(self) -> Iterator[None]:
        """What the body communicates and copies is not counted in the last step's stats."""
        kept = self.transfers.stats
        self.transfers.stats = TransferStats()
        try:
            with self.comm.stats.paused():  # (in place: the mesh's groups count in it too)
                yield
        finally:
            self.transfers.stats = kept

    def end_of_data(self) -> None:
        """Call instead of ``step(*batch)`` when this rank has no batch left. Returns when every
        rank ran out at the same micro-batch (training ends there; a partly accumulated step is
        dropped); otherwise raises DataExhaustedError here and, in their ``step(...)`` call, on
        every rank that still had a batch: ranks that train on different numbers of batches
        would wait for each other forever (or, under DDP, silently desynchronize)."""
        self.health.check_usable()
        self.health.set_status(f"out of data at step {self.counts.step_number}")
        self.agreement.settle(self._propose(END_OF_DATA))

    def _drop_window(self) -> int:
        """Leave the step as before the current accumulation window began (after a failed
        run): gradient accumulators zeroed, the window's micro-batches dropped; returns how
        many were."""
        self.state.zero_gradients()
        dropped = self.micro_batches % self.plan.grad_accumulation
        self.micro_batches -= dropped
        return dropped

    def _account_step(self, overflow: bool, flags: torch.Tensor | None = None) -> None:
        """After an optimizer step: count it (unless skipped: its update wrote nothing) and
        update the loss scale. A step whose gradient was not finite (``flags``: the program's
        per-unit flags) under ``precision.on_nonfinite: error`` raises NonFiniteError instead,
        counted neither as applied nor as skipped: its micro-batches are discarded (the program
        zeroed the gradient accumulators, as after any step; the micro-batch count goes back to
        the step's first), so the TrainStep is left as before the step."""
        if not overflow:
            self.steps += 1
        elif STEP_SPEC.key in self.state:
            self.state[STEP_SPEC.key].fill_(self.steps)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if overflow and flags is not None and self.plan.precision.nonfinite == "error":
            step = self.micro_batches // self.plan.grad_accumulation
            self.micro_batches -= self.plan.grad_accumulation
            if self.pipeline is not None:  # (each rank's flags name its stages' units)
                units = self.pipeline.nonfinite_units(flags)
            else:
                units = nonfinite_units(self.program, flags)
            raise nonfinite_error(units, self.comm.rank, step)

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step runs with (None without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped, their update writing nothing, because a reduced gradient
        held an inf or NaN (an overflow under loss scaling, or ``precision.on_nonfinite:
        skip``). Every step boundary run either applies its update or skips it, so this is
        boundaries less steps applied (a checkpoint, which saves both counters, keeps it)."""
        return self.micro_batches // self.plan.grad_accumulation - self.steps

    def _set_step_inputs(self) -> None:
        """The learning rate of the step about to run (the schedule's at the applied-step count)
        and AdamW's 1-based step counter: program inputs, set before each step's program runs."""
        self.state[LR_SPEC.key].fill_(self.lr)
        if STEP_SPEC.key in self.state:
            self.state[STEP_SPEC.key].fill_(self.steps + 1)

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step runs with (``optimizer.schedule`` at the
        count of applied steps: a step skipped for an overflow does not advance it)."""
        return lr_at(self.plan.optimizer, self.steps)

    @property
    def updates_next(self) -> bool:
        """Whether the next micro-batch is the last of its optimizer step (the one that
        updates)."""
        return (self.micro_batches + 1) % self.plan.grad_accumulation == 0
