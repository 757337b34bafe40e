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
(:mod:`zerocc.runtime.programs`), the state the programs bind (:mod:`zerocc.runtime.state_store`),
the ranks' agreement (:mod:`zerocc.runtime.agreement`), what failures become
(:mod:`zerocc.runtime.failures`) and the update a step carries into the next
(:mod:`zerocc.runtime.carried`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from zerocc.backends import resolve_backend
from zerocc.backends.kernels import check_kernels, host_kernels, kernel_set, resolve_kernels
from zerocc.compiler.capture import LossFn, ModelInfo, detach_inputs, traced_grad_mode
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.materialize import weight_source
from zerocc.compiler.mesh import Mesh
from zerocc.compiler.plan import Plan
from zerocc.compiler.schedule import lr_at
from zerocc.compiler.state import DEVICE, LOSS_SCALE_SPEC, LR_SPEC, NVME, STEP_SPEC, StateLayout
from zerocc.compiler.tensor_parallel import TensorParallel
from zerocc.compiler.units import Unit
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import Comm, CommStats
from zerocc.engine.failures import describe_node, failing_node
from zerocc.engine.host_worker import HostWorker, pin_host_update_threads
from zerocc.engine.transfers import Transfers, TransferStats
from zerocc.errors import OffloadError, RankMismatchError
from zerocc.ir.nodes import BATCH
from zerocc.runtime.agreement import END_OF_DATA, Agreement, RankAgreement, has_peers
from zerocc.runtime.carried import CarriedUpdate
from zerocc.runtime.failures import RankHealth, failed_run_error
from zerocc.runtime.loss_scale import LossScaler
from zerocc.runtime.measure import ProfiledRun, RecorderFactory
from zerocc.runtime.memory_check import check_model_states
from zerocc.runtime.nonfinite import nonfinite_error
from zerocc.runtime.nvme import open_store
from zerocc.runtime.programs import Program, ProgramBuilder, batch_signature
from zerocc.runtime.record import StepRecord
from zerocc.runtime.state_store import StateStore, align_random_state

__all__ = ["Program", "StepObserver", "StepRunner", "batch_signature"]


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


class StepRunner:
    """Runs the compiled training step of one rank, holding what it stands on: its compile
    session, the programs built (``programs``, by batch signature), the state they bind
    (``state``, a :class:`~zerocc.runtime.state_store.StateStore`), the agreement with the
    other ranks and the step counters: the runtime under :class:`zerocc.TrainStep`, which adds
    what users read about it."""

    observer: StepObserver = StepObserver()  # observes nothing (zerocc.TrainStep sets its own)

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        self.plan, self.loss_fn, self.comm, self.device = plan, loss_fn, comm, device
        self.model = model
        self.micro_batches = 0
        self.steps = 0  # optimizer steps applied (steps skipped for overflow not counted)
        self.health = RankHealth(comm, plan.backend.timeout_s, self._step_number)
        self.agreement = RankAgreement(self.health)
        source = weight_source(model)
        if has_peers(comm):  # before any group is made or weight read
            self.agreement.agree_on_start(plan, source)
        # What every program shares, worked out once as zerocc inspect does (the mesh, the
        # model described, under tensor parallelism as this rank's slices, the passes, the
        # units and the state they declare): the state is laid out in units before any
        # program exists (a checkpoint loads into it before the first call), and a plan that
        # cannot partition this model (a pattern that matches nothing) is an error here.
        self.session = CompileSession.open(model, plan, comm.world_size, loss_fn)
        # The ranks' layout: units are sharded over the `dp` group (every rank, or a shard
        # group under hybrid sharding or tensor parallelism, made here: a collective).
        comm.use_mesh(self.mesh)
        self.backend_name = resolve_backend(plan.backend.name, device)
        self.kernels = resolve_kernels(plan.backend.kernels, device, plan.precision.master)
        check_kernels(self.kernels, device)
        # States placed on NVMe live in files of this rank's store, checked for room before
        # anything is written.
        nvme = open_store(plan, comm.rank, self.layout.at(NVME))
        self.transfers = Transfers(nvme, device)
        host = HostWorker(threaded=device.type == "cuda")
        self.context = RuntimeContext(comm, self.transfers, kernel_set(self.kernels), device, host)
        # Where the time before training went, by phase (explain() and `zerocc train` say).
        self.setup_seconds: dict[str, float] = {}
        self.host_kernels: str | None = None  # the kernel set of host updates on a GPU machine
        if plan.offload.updates_on_host(device):
            pin_host_update_threads()
            with self._timed("host update kernels"):
                self.host_kernels = host_kernels()  # compiled here (one-pass), not in a step
        if plan.backend.check_memory:  # before anything is allocated: the states fit
            check_model_states(self.model_info, self.units, self.layout, plan, comm, device)
        self.initial_weights = None if source is None else source.describe()
        # The TrainStep owns the weights from here (``full_state_dict()`` returns them).
        with self._timed("model states"):
            self.state = StateStore.allocate(model, self.session, comm, device, nvme)
        if self.mesh.tp > 1:
            align_random_state(comm, self.session, device)
        self.loss_scaler: LossScaler | None = None
        if LOSS_SCALE_SPEC.key in self.state:
            self.loss_scaler = LossScaler.of(plan.precision, self.state[LOSS_SCALE_SPEC.key])
        self.builder = ProgramBuilder(
            self.session, self.context, self.agreement, self._timed, self.backend_name
        )
        self.programs: dict[tuple, Program] = {}
        self._last_program: Program | None = None
        self.carried = CarriedUpdate(self.state, self.context)  # (offload.defer_updates)

    @property
    def mesh(self) -> Mesh:
        """The ranks' layout (:class:`~zerocc.compiler.mesh.Mesh`)."""
        return self.session.mesh

    @property
    def full_model_info(self) -> ModelInfo:
        """Every parameter whole (checkpoints name and shape them so)."""
        return self.session.full_model_info

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """The layers the plan splits over the tp ranks, if any."""
        return self.session.tensor_parallel

    @property
    def model_info(self) -> ModelInfo:
        """What this rank holds: each split parameter's slice under tensor parallelism."""
        return self.session.model_info

    @property
    def units(self) -> list[Unit]:
        """The FSDP units every program is compiled for."""
        return self.session.units

    @property
    def layout(self) -> StateLayout:
        """The state every program binds, as the plan's passes declare it."""
        return self.session.layout

    @property
    def data_rank(self) -> int:
        """Which batch of each step this rank trains on: its rank, unless tensor parallelism
        groups ranks (the ranks of a tp group must be given the same batch)."""
        return self.mesh.data_rank(self.comm.rank)

    @property
    def data_parallel(self) -> int:
        """How many batches one step trains on: the world size, unless tensor parallelism
        groups ranks."""
        return self.mesh.data_parallel

    # -- the step loop ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the time the block takes to ``setup_seconds[phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.setup_seconds[phase] = self.setup_seconds.get(phase, 0.0) + seconds

    def __call__(self, *batch: Any) -> torch.Tensor:
        """Run one micro-batch of this rank; returns its loss."""
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
        program is lowered again, bound to ``comm``, once: later profiles there reuse it."""
        recorders: list[ProfiledRun] = []

        def recorded(program: Program) -> ProfiledRun:
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
        self, batch: tuple, recorded: Callable[[Program], ProfiledRun] | None = None
    ) -> torch.Tensor:
        """One micro-batch; ``recorded(program)``, when given, makes the recorder the program
        runs under (on an executable of its own) instead of the program's executable."""
        self.health.check_usable()
        batch = tuple(b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch)
        boundary = self.updates_next
        signature = batch_signature(batch)
        self.health.set_status(f"in step {self._step_number()}")
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
        args = [batch[int(k)] if role == BATCH else self.state[k] for role, k in program.bindings]
        recorder = recorded(program) if recorded is not None else None
        executable = recorder.executable if recorder is not None else program.run
        late = None if agreement.settled else lambda: self.agreement.settle(agreement)
        self.comm.stats.reset()
        self.transfers.stats.reset()
        try:
            with (
                traced_grad_mode(),  # some kernels' outputs depend on it (an LSTM's, on CPU)
                self.comm.checked_before_first_collective(late),
                self._timed("first run") if first_run else contextlib.nullcontext(),
            ):
                args = detach_inputs(args)  # so that grad mode records no autograd graph
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
            failure = self._run_failed(exc, program, signature if first_run else None)
            if failure is exc:
                raise
            raise failure from exc
        if not agreement.settled:  # (settled before the run, or at its first collective)
            self.agreement.settle(agreement)
        if first_run:
            self.programs[key] = program
        if executable.in_flight():
            raise RuntimeError("a program finished with collectives still in flight")
        self.micro_batches += 1
        self._last_program = program
        overflow, flags = False, None
        if program.returns_found_inf:
            # (loss, found_inf) under loss scaling; (loss, per-unit flags, found_inf) without.
            loss, *flags, found_inf = loss
            overflow, flags = bool(found_inf), flags[0] if flags else None
        if program.carries:  # this step's update runs at the start of the next program
            self.carried.pending = None if overflow else (self.steps + 1, self.lr)
        if boundary:
            self._account_step(overflow, flags)
            done = self.micro_batches // self.plan.grad_accumulation
            self.health.set_status(f"after step {done}")
        return loss

    def _propose(self, what: tuple, batch: tuple | None = None) -> Agreement:
        """Issue the ranks' agreement on the next micro-batch (see
        :meth:`~zerocc.runtime.agreement.RankAgreement.propose`): under tensor parallelism on
        the batch's contents too, within this rank's tp group."""
        tp_group = self.data_rank if self.mesh.tp > 1 else None
        return self.agreement.propose(what, batch, tp_group)

    def _build(self, batch: tuple, boundary: bool, training: bool = True) -> Program:
        """Build the program of ``batch`` (see :class:`~zerocc.runtime.programs.ProgramBuilder`),
        the observer told of it once its passes ran."""
        self.health.set_status(f"compiling a program for step {self._step_number()}")
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

    def evaluate(self, *batch: Any) -> torch.Tensor:
        """The loss of one micro-batch of this rank under the current weights, forward only:
        a program of its own (compiled on the first call of each batch signature, with the
        model in eval mode) gathers what forward needs and changes no state; training goes
        on as if it had not run. Collective: every rank calls it together (the ranks agree on
        the batch first)."""
        self.health.check_usable()
        batch = tuple(b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch)
        signature = batch_signature(batch)
        key = (signature, "evaluate")
        self.health.set_status(f"evaluating after step {self._step_number() - 1}")
        self.agreement.settle(self._propose(("evaluation batch", signature), batch))
        self.apply_carried_update()  # (after the agreement: under stages 1-2 it all-gathers)
        program = self.programs.get(key) or self._build(batch, boundary=False, training=False)
        args = [batch[int(k)] if role == BATCH else self.state[k] for role, k in program.bindings]
        try:
            with traced_grad_mode(), self._stats_kept():
                loss = program.run(*detach_inputs(args))
        except BaseException as exc:
            program.run.reset()
            if self.comm.failure is not None:
                node = failing_node(program.run.gm, exc.__traceback__)
                raise self.health.peer_failure(exc, describe_node(node)) from exc
            raise
        self.programs[key] = program
        return loss

    def apply_carried_update(self) -> None:
        """Apply the update a pipelined offload carried out of the last step now (nothing to do
        when none is pending): before anything reads the weights or the optimizer states.
        Under stages 1-2 on more than one rank it all-gathers the updated shards, so every rank
        calls it together (its callers are collective: a save or load, an evaluation,
        full_state_dict)."""
        self.carried.apply(self.programs.values())

    @contextlib.contextmanager
    def _stats_kept(self) -> Iterator[None]:
        """What the body communicates and copies is not counted in the last step's stats."""
        kept = self.comm.stats, self.transfers.stats
        self.comm.stats, self.transfers.stats = CommStats(), TransferStats()
        try:
            yield
        finally:
            self.comm.stats, self.transfers.stats = kept

    def end_of_data(self) -> None:
        """Call instead of ``step(*batch)`` when this rank has no batch left. Returns when every
        rank ran out at the same micro-batch (training ends there; a partly accumulated step is
        dropped); otherwise raises DataExhaustedError here and, in their ``step(...)`` call, on
        every rank that still had a batch: ranks that train on different numbers of batches
        would wait for each other forever (or, under DDP, silently desynchronize)."""
        self.health.check_usable()
        self.health.set_status(f"out of data at step {self._step_number()}")
        self.agreement.settle(self._propose(END_OF_DATA))

    def _step_number(self) -> int:
        """The 1-based number of the optimizer step the next micro-batch belongs to."""
        return self.micro_batches // self.plan.grad_accumulation + 1

    def _run_failed(
        self, exc: BaseException, program: Program, new_signature: tuple | None
    ) -> BaseException:
        """The error to raise for a program run that raised ``exc`` (``exc`` itself when
        nothing can be added). A failed collective is a peer that stopped answering: the
        heartbeats name it, and the group is closed (nothing more can run on it). Anything else
        leaves the step as before the micro-batch's accumulation window began: gradient
        accumulators zeroed, that window's micro-batches dropped; a new program that failed on
        its first run (``new_signature``) is not kept."""
        if isinstance(exc, OffloadError):
            return OffloadError(
                f"rank {self.comm.rank}, step {self.steps + 1}: {exc}. Training stopped: this "
                "step's update is incomplete; load the last checkpoint to go on"
            )
        node = failing_node(program.run.gm, exc.__traceback__)  # (named as the program's)
        step = self._step_number()
        if self.comm.failure is not None:
            return self.health.peer_failure(exc, describe_node(node))
        self.state.zero_gradients()
        dropped = self.micro_batches % self.plan.grad_accumulation
        self.micro_batches -= dropped
        return failed_run_error(
            exc,
            node,
            rank=self.comm.rank,
            step=step,
            dropped=dropped,
            new_signature=new_signature,
            earlier=[sig for sig, _ in self.programs],
        )

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
            raise nonfinite_error(self.program, flags, self.comm.rank, step)

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

    # -- inspection -------------------------------------------------------------------------

    @property
    def program(self) -> fx.GraphModule:
        """The scheduled graph of the last program run (or built)."""
        program = self._last_program or next(iter(self.programs.values()), None)
        if program is None:
            raise RuntimeError("no program yet: call step(*batch) once to compile")
        return program.gm

    @property
    def records(self) -> list[PassRecord]:
        """What each pass did to the last program: time, ops added and removed (and the graph
        after it where dumps keep it)."""
        return (self._last_program or next(iter(self.programs.values()))).records

    def record(self) -> StepRecord:
        """A plain record of this compiled step, for inspection (:mod:`zerocc.runtime.record`)."""
        last = self._last_program or next(iter(self.programs.values()), None)
        first = next(iter(self.programs), (None,))[0]
        return StepRecord(
            plan=self.plan,
            world_size=self.comm.world_size,
            rank=self.comm.rank,
            device_type=self.device.type,
            units=self.units,
            layout=self.layout,
            programs={b: p.gm for (sig, b), p in self.programs.items() if sig == first},
            program=last.gm if last else None,
            records=last.records if last else [],
            state_bytes=self.state_bytes_by_location(),
            loss_scale=self.loss_scale,
            dynamic_loss_scale=bool(self.loss_scaler and self.loss_scaler.dynamic),
            backend=self.backend_name,
            kernels=self.kernels,
            host_kernels=self.host_kernels,
            backend_notes=list(
                dict.fromkeys(note for p in self.programs.values() for note in p.notes())
            ),
            backend_artifacts=last.run.artifacts() if last else {},
            steps=self.steps,
            skipped_steps=self.skipped_steps,
            initial_weights=self.initial_weights,
            setup_seconds=dict(self.setup_seconds),
        )

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes of this rank's persistent params, grads and optimizer states (measured) in
        each place they live: ``device``, ``host`` and ``nvme``."""
        return self.state.bytes_by_location()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the live persistent params, grads and optimizer states of this rank on the
        device (measured); what offload placed elsewhere is in :meth:`state_bytes_by_location`."""
        return self.state_bytes_by_location()[DEVICE]

    def summary(self) -> dict[str, Any]:
        """Figures of the last step: bytes per collective kind, model-state bytes per rank (on
        the device), bytes offload moved per direction, the loss scale (None without scaling),
        the steps skipped for a non-finite gradient (see :attr:`skipped_steps`) and the seconds
        spent before training, by phase."""
        return {
            "comm_bytes_per_step": dict(self.comm.stats.bytes),
            "model_state_bytes": self.model_state_bytes()["total"],
            "offload_bytes_per_step": dict(self.transfers.stats.bytes),
            "loss_scale": self.loss_scale,
            "skipped_steps": self.skipped_steps,
            "setup_seconds": dict(self.setup_seconds),
        }

    # -- the state ----------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full tensor on CPU}`` for every key of ``model.state_dict()``, in the model's
        dtypes: the master weights under mixed precision.

        A collective when the weights are sharded (stage 3; stages 1-2 under mixed precision,
        whose masters are sharded): call it on every rank.
        """
        self.apply_carried_update()
        return self.state.full_state_dict()

    def materialize_model(self, device: str | torch.device = "cpu") -> nn.Module:
        """The model given to ``compile`` (which sits on ``meta`` once the step owns its
        weights) with the step's current weights and buffers, on ``device``: to evaluate it,
        generate with it or save it as usual. A copy: the step trains its own weights, so call
        again for newer ones. Every rank holds the whole model afterwards; a collective where
        the weights are sharded (see :meth:`full_state_dict`): call it on every rank."""
        self.apply_carried_update()
        return self.state.materialize_model(self.model, device)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards, optimizer state and counters, ready for
        ``torch.distributed.checkpoint.save`` (or ``torch.save``). Tensor keys carry the rank
        (``rank1/transformer.h.0.param``) since every rank holds different shards; reload
        with the same plan and world size. Applies a pipelined offload's update in flight
        first, which under stages 1-2 all-gathers: call it on every rank then."""
        self.apply_carried_update()
        sd: dict[str, Any] = dict(self.state.state_dict())
        sd["zerocc"] = {
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            **self._sharding(),
        }
        if self.loss_scaler is not None:
            sd["zerocc"]["loss_scaler"] = self.loss_scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (after ``dcp.load(sd, ...)`` filled it in)."""
        self.apply_carried_update()  # (offload.defer_updates) none left to apply over what loads
        # (saved before hybrid sharding and tensor parallelism: no replicas, no split)
        saved = {"replicate": 1, "tp": 1, **sd["zerocc"]}
        for field, mine in self._sharding().items():
            if saved[field] != mine:
                raise RankMismatchError(
                    f"checkpoint was saved with {field}={saved[field]}, this run has {field}={mine}"
                )
        self.state.load_state_dict(sd)
        self.steps, self.micro_batches = saved["steps"], saved["micro_batches"]
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(saved["loss_scaler"])

    def _sharding(self) -> dict[str, int]:
        """How this run shards its state: what a rank's state_dict() holds depends on it."""
        return {
            "world_size": self.comm.world_size,
            "stage": self.plan.zero.stage,
            "replicate": self.plan.zero.replicate,
            "tp": self.mesh.tp,
        }
