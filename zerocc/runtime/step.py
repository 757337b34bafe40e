"""StepRunner: runs the compiled training step of a rank, and owns the state it keeps.

``step(*batch)`` runs one micro-batch on this rank: forward, backward, communication and, on
every ``grad_accumulation``-th call, the optimizer update. Programs are compiled on first sight
of a batch signature (shapes, dtypes, non-tensor values) and cached, one for micro-batches that
step and one for those that only accumulate. On each call the ranks agree on the signature (a
mismatch is an error on every rank, never a hang): the agreement is issued at once and settled
before this rank compiles, or, for a cached program, right before its first collective, so that
its round trip runs behind the work before it (see :mod:`zerocc.runtime.agreement`). Before a new
program first runs the ranks compare its hash (a mismatch names the first differing line).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import fx, nn

from zerocc.backends import Executable, get_backend, resolve_backend
from zerocc.backends.kernels import check_kernels, host_kernels, kernel_set, resolve_kernels
from zerocc.compiler.capture import LossFn, ModelInfo, detach_inputs, traced_grad_mode
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.driver.program import CompiledProgram
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.materialize import WeightSource, is_meta, release_to_meta, weight_source
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.tensor_parallel import TensorParallel
from zerocc.compiler.passes.deferred_updates import (
    CARRIED_LR,
    CARRIED_SCALARS,
    CARRIED_SKIP,
    CARRIED_STEP,
    carried_program,
)
from zerocc.compiler.plan import Plan
from zerocc.compiler.schedule import lr_at
from zerocc.compiler.state import (
    DEVICE,
    LOSS_SCALE_SPEC,
    LR_SPEC,
    NVME,
    STEP_SPEC,
    StateLayout,
    allocate_state,
)
from zerocc.compiler.units import Unit
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import Comm, CommStats
from zerocc.engine.failures import (
    describe_node,
    failing_node,
    first_line,
    peer_failure,
    signature_difference,
)
from zerocc.engine.host_memory import state_tensor
from zerocc.engine.host_worker import HostWorker, pin_host_update_threads
from zerocc.engine.transfers import Transfers, TransferStats
from zerocc.errors import (
    BatchError,
    CaptureError,
    InvariantError,
    LoweringWarning,
    OffloadError,
    RankMismatchError,
    RankStoppedError,
)
from zerocc.ir.nodes import (
    BATCH,
    FOUND_INF,
    GRAD,
    info,
    placeholders,
    val,
)
from zerocc.ir.ops import DP_GROUP, TP_GROUP
from zerocc.ir.printing import format_program
from zerocc.runtime.agreement import (
    END_OF_DATA,
    Agreement,
    agrees_at_first_collective,
    batch_digest,
    batch_disagreement,
    digest,
    first_difference,
    has_peers,
    views_if_they_differ,
)
from zerocc.runtime.loss_scale import LossScaler
from zerocc.runtime.measure import ProfiledRun, RecorderFactory
from zerocc.runtime.memory_check import check_model_states, check_step_memory
from zerocc.runtime.nonfinite import nonfinite_error
from zerocc.runtime.nvme import open_store
from zerocc.runtime.record import StepRecord
from zerocc.runtime.state_memory import state_bytes_by_location


@dataclass
class Program:
    """One compiled program: the scheduled graph, how it was built, and its runnable form."""

    gm: fx.GraphModule
    records: list[PassRecord]
    bindings: list[tuple[str, str]]  # (role, key) per placeholder, in order
    example_inputs: list[Any]  # the placeholders' fake values
    run: Executable  # bound to the step's runtime context
    digest: str
    returns_found_inf: bool  # returns (loss, [flags,] found_inf): it steps, gated on the flag
    agrees_at_first_collective: bool  # the batch agreement may be settled that late
    carries: bool = False  # begins with the last step's host updates (offload.defer_updates)
    lowered_apart: str | None = None  # how each rank lowered it, where the ranks differ

    def notes(self) -> list[str]:
        """The backend's lines for ``explain()``, and one where the ranks lowered it apart."""
        return self.run.notes() + ([self.lowered_apart] if self.lowered_apart else [])


def batch_signature(batch: Sequence[Any]) -> tuple:
    """What makes two batches need different programs: tensor shapes/dtypes, other values."""
    return tuple(
        ("tensor", tuple(b.shape), str(b.dtype)) if isinstance(b, torch.Tensor) else ("value", b)
        for b in batch
    )


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
    """Runs the compiled training step of one rank and owns the state it keeps between steps:
    the runtime under :class:`zerocc.TrainStep`, which adds what users read about it."""

    observer: StepObserver = StepObserver()  # observes nothing (zerocc.TrainStep sets its own)

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        self.plan, self.loss_fn, self.comm, self.device = plan, loss_fn, comm, device
        self.model = model
        self.micro_batches = 0
        self.steps = 0  # optimizer steps applied (steps skipped for overflow not counted)
        source = weight_source(model)
        if has_peers(comm):  # before any group is made or weight read
            self._agree_on_start(source)
        # What every program shares, worked out once as zerocc inspect does (the mesh, the
        # model described, under tensor parallelism as this rank's slices, the passes, the
        # units and the state they declare): the state is laid out in units before any
        # program exists (a checkpoint loads into it before the first call), and a plan that
        # cannot partition this model (a pattern that matches nothing) is an error here.
        self.session = CompileSession.open(model, plan, comm.world_size, loss_fn)
        # The ranks' layout: units are sharded over the `dp` group (every rank, or a shard
        # group under hybrid sharding or tensor parallelism, made here: a collective).
        comm.use_mesh(self.mesh)
        self.state_dict_keys = list(model.state_dict(keep_vars=True))
        self.backend_name = resolve_backend(plan.backend.name, device)
        self.backend = get_backend(self.backend_name)
        self.kernels = resolve_kernels(plan.backend.kernels, device, plan.precision.master)
        check_kernels(self.kernels, device)
        # States placed on NVMe live in files of this rank's store, checked for room before
        # anything is written, every other state in ``self.state``.
        self.nvme_specs = self.layout.at(NVME)
        self.store = open_store(plan, comm.rank, self.nvme_specs)
        self.transfers = Transfers(self.store, device)
        self.context = RuntimeContext(
            comm,
            self.transfers,
            kernel_set(self.kernels),
            device,
            HostWorker(threaded=device.type == "cuda"),
        )
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
        # Parameters are built one unit at a time, so a meta-device model never has more than
        # one unit materialized (read from its weight files, if it was given them); afterwards
        # the TrainStep owns the weights
        # (``full_state_dict()`` returns them) and the model's own copy is released.
        with self._timed("model states"):
            self.state: dict[str, torch.Tensor] = allocate_state(
                model,
                self.model_info,
                self.units,
                self.layout,
                plan.seed,
                self.mesh.shard_rank(comm.rank),
                device,
                partial(state_tensor, device=device),
                self.store,
                from_rank_0=comm.broadcast if comm.world_size > 1 else None,
                split=None if self.tensor_parallel is None else self._my_slices,
            )
            if not is_meta(model):
                release_to_meta(model)
        if self.mesh.tp > 1:
            self._align_random_state()
        self.loss_scaler: LossScaler | None = None
        if LOSS_SCALE_SPEC.key in self.state:
            self.loss_scaler = LossScaler.of(plan.precision, self.state[LOSS_SCALE_SPEC.key])
        self.programs: dict[tuple, Program] = {}
        self._builds = 0  # programs compiled, the failed ones too: the same on every rank
        # Programs lowered again on another comm or by another backend (profiling), kept for
        # the next profile of the same program there (a first run costs more than the others):
        # the same on every rank.
        self._lowered_again: dict[tuple[str, Comm, str | None], Executable] = {}
        self._last_program: Program | None = None
        # offload.defer_updates: the (step count, rate) of the update the last step carried into
        # the next, None when none is pending; and the program that applies it on its own.
        self._carried: tuple[int, float] | None = None
        self._drain: Program | None = None

    @property
    def mesh(self) -> Mesh:
        """The ranks' layout (:class:`~zerocc.compiler.parallel.mesh.Mesh`)."""
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

    # -- running ----------------------------------------------------------------------------

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
                executable = self._lowered_on(program, on, backend)
            states = self.model_state_bytes()
            recorders.append(recorder(executable, self.comm.rank, states, program=program.gm))
            return recorders[-1]

        loss = self._step(batch, recorded)
        return loss, recorders[0]

    def _lowered_on(self, program: Program, comm: Comm, backend: str | None = None) -> Executable:
        """``program`` lowered again by ``backend`` (default: the plan's), its collectives
        bound to ``comm``, or as it was the last time it was asked for; the ranks meet after a
        lowering, as after the program's first (Inductor: a cache hit on one rank may be a full
        compile on another)."""
        key = (program.digest, comm, backend)
        if key in self._lowered_again:
            return self._lowered_again[key]
        lower = self.backend if backend is None else get_backend(backend)
        executable = lower(program.gm, program.example_inputs, replace(self.context, comm=comm))
        self._lowered_again[key] = executable
        tag = f"relowered-{len(self._lowered_again)}"
        self._wait_for_ranks(tag, "a program to be lowered")
        return executable

    def _step(
        self, batch: tuple, recorded: Callable[[Program], ProfiledRun] | None = None
    ) -> torch.Tensor:
        """One micro-batch; ``recorded(program)``, when given, makes the recorder the program
        runs under (on an executable of its own) instead of the program's executable."""
        self._check_usable()
        batch = tuple(b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch)
        boundary = self.updates_next
        signature = batch_signature(batch)
        self._set_status(f"in step {self._step_number()}")
        key = (signature, boundary)
        agreement = self._propose(("next batch", signature, boundary), batch)
        program = self.programs.get(key)
        first_run = program is None
        if program is None:  # kept once it has run: a program that fails is not
            self._settle(agreement)  # every rank compiles it, or none does
            program = self._build(batch, boundary)
        elif not program.agrees_at_first_collective or program.carries:
            self._settle(agreement)  # (a carried update runs before the first collective)
        if boundary:
            self._set_step_inputs()
        if program.carries:
            self._set_carried_inputs()
        args = [batch[int(k)] if role == BATCH else self.state[k] for role, k in program.bindings]
        recorder = recorded(program) if recorded is not None else None
        executable = recorder.executable if recorder is not None else program.run
        late = None if agreement.settled else lambda: self._settle(agreement)
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
                self._carried = None
            if exc is agreement.error:  # the ranks disagree: stopped before anything was written
                if boundary and STEP_SPEC.key in self.state:
                    self.state[STEP_SPEC.key].fill_(self.steps)
                raise
            if not agreement.settled:  # the peers settle it: so must this rank, then fail
                with contextlib.suppress(Exception):
                    self._settle(agreement)
            failure = self._run_failure(exc, program, signature if first_run else None)
            if failure is exc:
                raise
            raise failure from exc
        if not agreement.settled:  # (settled before the run, or at its first collective)
            self._settle(agreement)
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
            self._carried = None if overflow else (self.steps + 1, self.lr)
        if boundary:
            self._account_step(overflow, flags)
            self._set_status(f"after step {self.micro_batches // self.plan.grad_accumulation}")
        return loss

    def evaluate(self, *batch: Any) -> torch.Tensor:
        """The loss of one micro-batch of this rank under the current weights, forward only:
        a program of its own (compiled on the first call of each batch signature, with the
        model in eval mode) gathers what forward needs and changes no state; training goes
        on as if it had not run. Collective: every rank calls it together (the ranks agree on
        the batch first)."""
        self._check_usable()
        batch = tuple(b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch)
        signature = batch_signature(batch)
        key = (signature, "evaluate")
        self._set_status(f"evaluating after step {self._step_number() - 1}")
        agreement = self._propose(("evaluation batch", signature), batch)
        self._settle(agreement)
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
                raise self._peer_failure(exc, describe_node(node)) from exc
            raise
        self.programs[key] = program
        return loss

    def _set_carried_inputs(self) -> None:
        """What a pipelined program's carried updates read that no step copies: the step count
        and rate of the update pending, or a skip when none is (or that step overflowed)."""
        step, lr = self._carried or (1, 0.0)
        values = {CARRIED_SKIP: float(self._carried is None), CARRIED_STEP: step, CARRIED_LR: lr}
        for key, dtype in CARRIED_SCALARS.items():
            self.transfers.host_buffers.get(key, (1,), dtype).fill_(values[key])

    def apply_carried_update(self) -> None:
        """Apply the update a pipelined offload carried out of the last step now, with what
        the step left in host buffers (nothing to do when none is pending): before anything
        reads the weights or the optimizer states. Under stage 3 local to the rank; under
        stages 1-2 on more than one rank it all-gathers the updated shards, so every rank calls
        it together (its callers are collective: a save or load, an evaluation,
        full_state_dict)."""
        if self._carried is None:
            return
        if self._drain is None:
            stepping = next(p for p in self.programs.values() if p.carries)
            gm = carried_program(stepping.gm)
            inputs = [val(n) for n in placeholders(gm)]
            bindings = [(info(n).role, info(n).key) for n in placeholders(gm)]
            run = get_backend("eager")(gm, inputs, self.context)  # host work: nothing to fuse
            self._drain = Program(gm, [], bindings, inputs, run, "", False, False, carries=True)
        self._set_carried_inputs()
        drain = self._drain
        try:
            with traced_grad_mode():
                drain.run(*detach_inputs([self.state[k] for _, k in drain.bindings]))
        except BaseException:
            drain.run.reset()
            raise
        self._carried = None

    @contextlib.contextmanager
    def _stats_kept(self) -> Iterator[None]:
        """What the body communicates and copies is not counted in the last step's stats."""
        kept = self.comm.stats, self.transfers.stats
        self.comm.stats, self.transfers.stats = CommStats(), TransferStats()
        try:
            yield
        finally:
            self.comm.stats, self.transfers.stats = kept

    def _run_failure(
        self, exc: BaseException, program: Program, new_signature: tuple | None
    ) -> BaseException:
        """The error to raise for a program run that raised ``exc`` (``exc`` itself when
        nothing can be added; see :meth:`_run_failed`)."""
        if isinstance(exc, OffloadError):
            return OffloadError(
                f"rank {self.comm.rank}, step {self.steps + 1}: {exc}. Training stopped: this "
                "step's update is incomplete; load the last checkpoint to go on"
            )
        return self._run_failed(exc, program, new_signature)

    def end_of_data(self) -> None:
        """Call instead of ``step(*batch)`` when this rank has no batch left. Returns when every
        rank ran out at the same micro-batch (training ends there; a partly accumulated step is
        dropped); otherwise raises DataExhaustedError here and, in their ``step(...)`` call, on
        every rank that still had a batch: ranks that train on different numbers of batches
        would wait for each other forever (or, under DDP, silently desynchronize)."""
        self._check_usable()
        self._set_status(f"out of data at step {self._step_number()}")
        self._settle(self._propose(END_OF_DATA))

    def _step_number(self) -> int:
        """The 1-based number of the optimizer step the next micro-batch belongs to."""
        return self.micro_batches // self.plan.grad_accumulation + 1

    def _set_status(self, status: str) -> None:
        """What this rank is doing, as its heartbeat tells the others (an attribute write)."""
        if self.comm.heartbeat is not None:
            self.comm.heartbeat.status = status

    def _check_usable(self) -> None:
        if self.comm.failure is not None:
            raise RankStoppedError(
                f"rank {self.comm.rank}: this training step cannot go on: its process group "
                f"failed ({first_line(self.comm.failure)}); start the ranks again and load "
                "the last checkpoint"
            )

    def _run_failed(
        self, exc: BaseException, program: Program, new_signature: tuple | None
    ) -> BaseException:
        """The error to raise for a program run that raised ``exc`` (``exc`` itself when
        nothing can be added). A failed collective is a peer that stopped answering: the
        heartbeats name it, and the group is closed (nothing more can run on it). Anything else
        leaves the step as before the micro-batch's accumulation window began: gradient
        accumulators zeroed, that window's micro-batches dropped; a new program that failed on
        its first run (``new_signature``) is not kept."""
        node = failing_node(program.run.gm, exc.__traceback__)  # (named as the program's)
        step = self._step_number()
        if self.comm.failure is not None:
            return self._peer_failure(exc, describe_node(node))
        for spec in self.layout:
            if spec.role == GRAD and spec.key in self.state:
                self.state[spec.key].zero_()
        dropped = self.micro_batches % self.plan.grad_accumulation
        self.micro_batches -= dropped
        if node is not None and info(node).phase == "optimizer":
            detail = "the update may be partly applied: load the last checkpoint to go on"
        else:
            detail = "nothing was updated" + (
                f"; the {dropped} micro-batch(es) accumulated for this step were dropped"
                if dropped
                else ""
            )
        if not isinstance(exc, Exception) or isinstance(exc, torch.OutOfMemoryError):
            return exc
        earlier = [sig for sig, _ in self.programs]
        if new_signature is None or not earlier:
            exc.add_note(f"zerocc: rank {self.comm.rank}, step {step}: in {describe_node(node)}")
            return exc
        return BatchError(
            f"rank {self.comm.rank}, step {step}: the program compiled for a new batch signature "
            f"({signature_difference(new_signature, earlier)}) failed on its first run in "
            f"{describe_node(node)}: {type(exc).__name__}: {first_line(exc)}. The program was "
            f"not kept and {detail}. Give the model batches of the dtypes it takes (cast them in "
            "the data pipeline or the loss_fn)"
        )

    def _peer_failure(self, exc: BaseException, where: str) -> RankStoppedError:
        return peer_failure(self.comm, exc, where, self._step_number(), self.plan.backend.timeout_s)

    def _propose(self, what: tuple, batch: tuple | None = None) -> Agreement:
        """Issue the ranks' agreement on the next micro-batch (its signature, or that there is
        none) without waiting for it; :meth:`_settle` waits. Under tensor parallelism the
        ranks of a tp group agree on ``batch``'s contents too: they train on one batch, and
        different ones would train a wrong model without any other error."""
        within = None
        if self.mesh.tp > 1:
            content = batch_digest(batch) if batch is not None else ""
            within = (self.mesh.data_rank(self.comm.rank), content)
        try:
            return Agreement(self.comm, what, repr(what), within)
        except Exception as exc:  # the group failed already
            raise self._peer_failure(exc, f"the ranks' agreement on the {what[0]}") from exc

    def _settle(self, agreement: Agreement) -> None:
        """Wait for the ranks' agreement on the next micro-batch; raise on every rank when they
        differ (RankMismatchError, DataExhaustedError) or a peer stopped answering
        (RankStoppedError). What it raises is kept as ``agreement.error``."""
        try:
            views = agreement.views_if_they_differ()
        except Exception as exc:  # a peer that stopped answering, or left
            failure = self._peer_failure(exc, f"the ranks' agreement on the {agreement.what[0]}")
            agreement.error = failure
            raise failure from exc
        if views is not None:
            agreement.error = batch_disagreement(views, self.comm.rank, self._step_number())
            raise agreement.error
        if split := agreement.split_groups():
            groups = "; ".join(
                " vs ".join(", ".join(map(str, ranks)) for ranks in group) for group in split
            )
            agreement.error = RankMismatchError(
                f"rank {self.comm.rank}, step {self._step_number()}: the ranks of a "
                f"tensor-parallel group were given different batches (ranks {groups}); the "
                "ranks of a tp group train on one batch: give each rank the batch of its "
                "data-parallel rank, step.data_rank of step.data_parallel"
            )
            raise agreement.error

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

    def _compile(
        self,
        batch: tuple,
        boundary: bool,
        plan: Plan | None = None,
        keep_graphs: bool = False,
        training: bool = True,
    ) -> CompiledProgram:
        """Capture the step on ``batch`` and run the passes of ``plan`` (default: this step's;
        another one to predict what a plan change would need); ``training=False``: the
        forward-only program of :meth:`evaluate`."""
        return self.session.program(
            batch,
            boundary=boundary,
            device=self.device,
            plan=plan,
            keep_graphs=keep_graphs,
            training=training,
        )

    def _build(self, batch: tuple, boundary: bool, training: bool = True) -> Program:
        self._set_status(f"compiling a program for step {self._step_number()}")
        keep = self.observer.keeps_pass_graphs
        with self._timed("capture and passes"):
            compiled = self._compile(batch, boundary, keep_graphs=keep, training=training)
        gm, records = compiled.gm, compiled.records
        kind = "step" if boundary else "accumulate" if training else "evaluate"
        self.observer.program_built(self, f"{kind}-{len(self.programs)}", records)
        if compiled.layout != self.layout:  # the passes declare the same state on every compile
            raise InvariantError(
                "a program's passes laid out other state than the TrainStep allocated: "
                + compiled.layout.difference(self.layout)
            )
        self._check_bindings(gm)
        text = format_program(gm)
        program_digest = digest(text)
        self._builds += 1
        self._wait_for_ranks(f"compiled-{self._builds}", "a program to compile")
        self._agree(
            ("compiled program", program_digest), "the compiled programs differ across ranks", text
        )
        bindings = [(info(n).role, info(n).key) for n in placeholders(gm)]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        found_inf = isinstance(outputs, tuple) and info(outputs[-1]).role == FOUND_INF
        late_agreement = agrees_at_first_collective(gm)
        carries = any(info(n).carried for n in gm.graph.nodes)
        if self.plan.backend.check_memory:  # before its first run: the step's memory fits
            check_step_memory(
                gm,
                self.units,
                self.layout,
                self.plan,
                self.comm,
                self.device,
                lambda plan: self._compile(batch, boundary, plan, training=training).gm,
            )
        example_inputs = [val(n) for n in placeholders(gm)]
        with self._timed("lowering"):
            executable = self.backend(gm, example_inputs, self.context)
        # Lowering compiles too (Inductor: seconds to minutes, a cache hit on one rank and not
        # on another): no rank runs the program's first collective while another still lowers.
        self._wait_for_ranks(f"lowered-{self._builds}", "a program to be lowered")
        lowered_apart = self._lowered_apart(executable.lowering())
        return Program(
            gm,
            records,
            bindings,
            example_inputs,
            executable,
            program_digest,
            found_inf,
            late_agreement,
            carries,
            lowered_apart,
        )

    def _lowered_apart(self, lowering: str) -> str | None:
        """None when every rank lowered the program as this one did (``lowering``); else a
        line naming each rank's form, warned (:class:`LoweringWarning`) on every rank."""
        views = self._views_if_they_differ(("program's lowering", lowering), lowering)
        if views is None:
            return None
        forms = "; ".join(f"rank {rank}: {form}" for rank, form in enumerate(views))
        line = (
            f"{self.backend_name}: the ranks lowered this program differently ({forms}); the "
            "collectives are the same, so it trains, each rank's compute rounding its own way; "
            "each rank's explain() says why"
        )
        warnings.warn(line, LoweringWarning, stacklevel=2)
        return line

    def _wait_for_ranks(self, tag: str, doing: str) -> None:
        """Return once every rank got here: compiling takes what it takes, while ranks live
        (their heartbeats); a rank silent for ``backend.timeout_s`` stops every rank."""
        if self.comm.heartbeat is not None:
            self.comm.heartbeat.wait_for_all(tag, self.plan.backend.timeout_s, doing)

    # -- state ------------------------------------------------------------------------------

    def _check_bindings(self, gm: fx.GraphModule) -> None:
        """Every state placeholder of a program names a tensor the TrainStep holds, as shaped."""
        for node in placeholders(gm):
            record, fake = info(node), val(node)
            if record.role == BATCH:
                continue
            held = self.state.get(record.key)
            if held is None or held.shape != fake.shape or held.dtype != fake.dtype:
                raise CaptureError(
                    f"program placeholder {node.name!r} ({record.role} {record.key!r}, "
                    f"{tuple(fake.shape)} {fake.dtype}) matches no state tensor"
                )

    # -- agreement across ranks -------------------------------------------------------------

    def _agree(self, what: tuple, problem: str, detail: str | None = None) -> None:
        """Raise on every rank when ranks disagree on ``what`` (8-byte hash compared first)."""
        views = self._views_if_they_differ(what, detail if detail is not None else repr(what))
        if views is not None:
            raise RankMismatchError(f"rank {self.comm.rank}: {problem}: " + first_difference(views))

    def _agree_on_start(self, source: WeightSource | None) -> None:
        """Raise on every rank when the ranks do not start alike: their torch releases, plans
        (but for the fields a host sets its own way, ``Plan.shared_lines``) or weight sources
        (files copied to each host that are not the same). Each rank has its own; a learning
        rate, a schedule or weight files that differ change no compiled program, so without
        this the model would train on from a mix of them, silently."""
        weights = source.fingerprint() if source is not None else "the model's own values"
        start = (
            f"torch {torch.__version__}\nplan:\n{self.plan.shared_lines()}\n"
            f"initial weights: {weights}"
        )
        self._agree(
            ("start", digest(start)),
            "the ranks do not start alike (each has its own torch, plan and weight files: "
            "give every rank the same)",
            start,
        )

    def _views_if_they_differ(self, what: tuple, detail: str) -> list[Any] | None:
        try:
            return views_if_they_differ(self.comm, what, detail)
        except Exception as exc:  # a peer that stopped answering, or left
            raise self._peer_failure(exc, f"the ranks' agreement on the {what[0]}") from exc

    def _resident_and_nvme_state(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor: those held in memory, and those on NVMe read back."""
        state = dict(self.state)
        for spec in self.nvme_specs:
            state[spec.key] = torch.empty(spec.shape, dtype=spec.dtype)
            self.store.read(spec.key, state[spec.key]).wait()
        return state

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
        return state_bytes_by_location(self.state, self.layout, self.store)

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

    # -- checkpoints ------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full tensor on CPU}`` for every key of ``model.state_dict()``, in the model's
        dtypes: the master weights under mixed precision.

        A collective when the weights are sharded (stage 3; stages 1-2 under mixed precision,
        whose masters are sharded): call it on every rank.
        """
        full: dict[str, torch.Tensor] = {}
        self.apply_carried_update()
        state = self._resident_and_nvme_state()
        for unit in self.units:
            flat = state.get(f"{unit.key}.master", state[f"{unit.key}.param"])
            if flat.numel() != unit.padded_numel:
                gathered = flat.new_empty(unit.padded_numel)
                self.comm.on(DP_GROUP).all_gather(gathered, flat).wait()
                flat = gathered
            for p in unit.params:
                value = self._joined(p.fqn, unit.unflatten(flat)[p.fqn])
                value = value.detach().to("cpu", p.param.dtype, copy=True)
                full.update(dict.fromkeys(p.param.aliases, value))
        for b in self.model_info.buffers:
            if b.fqn in self.state:
                full.update(dict.fromkeys(b.aliases, self.state[b.fqn].detach().cpu().clone()))
        return {k: full[k] for k in self.state_dict_keys if k in full}

    def _align_random_state(self) -> None:
        """Give the ranks of this rank's tp group its first rank's random number generators
        (a collective on ``tp``). They run one program on tensors of one shape, so they stay
        in step from here: dropout where they all hold the whole tensor draws one mask, as it
        must (ranks seeded by their rank would otherwise drift apart without an error)."""
        group = self.comm.on(TP_GROUP)
        first = self.comm.rank - self.mesh.tp_rank(self.comm.rank)  # (its global rank)
        state = torch.get_rng_state().to(self.device)
        group.broadcast(state, first)
        torch.set_rng_state(state.cpu())
        if self.device.type == "cuda":
            state = torch.cuda.get_rng_state(self.device).to(self.device)
            group.broadcast(state, first)
            torch.cuda.set_rng_state(state.cpu(), self.device)

    def _my_slices(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of full parameter values (tensor parallelism)."""
        assert self.tensor_parallel is not None
        return self.tensor_parallel.local_values(values, self.mesh.tp_rank(self.comm.rank))

    def _joined(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """The full value of a parameter of which this rank holds ``value``: gathered from
        the tp ranks when tensor parallelism splits it (a collective on the ``tp`` group)."""
        split = self.tensor_parallel.splits.get(fqn) if self.tensor_parallel else None
        if split is None:
            return value
        parts = value.new_empty((split.parts, *value.shape))
        self.comm.on(TP_GROUP).all_gather(parts.view(-1), value.contiguous().view(-1)).wait()
        return split.join(list(parts))

    def materialize_model(self, device: str | torch.device = "cpu") -> nn.Module:
        """The model given to ``compile`` (which sits on ``meta`` once the step owns its
        weights) with the step's current weights and buffers, on ``device``: to evaluate it,
        generate with it or save it as usual. A copy: the step trains its own weights, so call
        again for newer ones. Every rank holds the whole model afterwards; a collective where
        the weights are sharded (see :meth:`full_state_dict`): call it on every rank."""
        full = self.full_state_dict()
        buffers = {b.fqn: self.state[b.fqn] for b in self.model_info.buffers if b.fqn in self.state}
        self.model.to_empty(device=device)
        self.model.load_state_dict(full)
        held = dict(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for fqn, value in buffers.items():  # non-persistent ones too (not in state_dict)
                held[fqn].copy_(value)
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards, optimizer state and counters, ready for
        ``torch.distributed.checkpoint.save`` (or ``torch.save``). Tensor keys carry the rank
        (``rank1/transformer.h.0.param``) since every rank holds different shards; reload
        with the same plan and world size. Applies a pipelined offload's update in flight
        first, which under stages 1-2 all-gathers: call it on every rank then."""
        prefix = f"rank{self.comm.rank}/"
        self.apply_carried_update()
        sd: dict[str, Any] = {
            prefix + k: t
            for k, t in self._resident_and_nvme_state().items()
            if not k.endswith(".param_shard")
        }
        sd["zerocc"] = {
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "world_size": self.comm.world_size,
            "stage": self.plan.zero.stage,
            "replicate": self.plan.zero.replicate,
            "tp": self.mesh.tp,
        }
        if self.loss_scaler is not None:
            sd["zerocc"]["loss_scaler"] = self.loss_scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (after ``dcp.load(sd, ...)`` filled it in)."""
        self.apply_carried_update()  # (offload.defer_updates) none left to apply over what loads
        # (saved before hybrid sharding and tensor parallelism: no replicas, no split)
        saved = {"replicate": 1, "tp": 1, **sd["zerocc"]}
        mine_by_field = {
            "world_size": self.comm.world_size,
            "stage": self.plan.zero.stage,
            "replicate": self.plan.zero.replicate,
            "tp": self.mesh.tp,
        }
        for field, mine in mine_by_field.items():
            if saved[field] != mine:
                raise RankMismatchError(
                    f"checkpoint was saved with {field}={saved[field]}, this run has {field}={mine}"
                )
        prefix = f"rank{self.comm.rank}/"
        nvme = {s.key for s in self.nvme_specs}
        expected = {k for k in [*self.state, *nvme] if not k.endswith(".param_shard")}
        missing = sorted(expected - {k.removeprefix(prefix) for k in sd if k.startswith(prefix)})
        if missing:
            raise RankMismatchError(f"checkpoint lacks {missing[:3]} for rank {self.comm.rank}")
        for key in expected - nvme:
            if sd[prefix + key] is not self.state[key]:
                self.state[key].copy_(sd[prefix + key])
        for key in nvme:
            value = sd[prefix + key].detach().to("cpu").contiguous()
            self.store.write(key, value).wait()
        self.steps, self.micro_batches = saved["steps"], saved["micro_batches"]
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(saved["loss_scaler"])
