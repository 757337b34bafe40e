"""One pipeline rank's part of a training step: walk its schedule's actions, running the stage
programs they name (issue 47).

The stage programs come from the stage cut (:mod:`zerocc.compiler.parallel.stage_cut`), in step
form (:func:`~zerocc.compiler.parallel.stage_cut.step_form`), and the order from a schedule
(:mod:`zerocc.compiler.parallel.pipeline_schedule`). For each action of its list a rank runs
one program on one micro-batch:

- ``F``: the stage's forward, on the activations the stage before sent (the batch, for the
  first); it sends its own on, keeps what its backward reads, and (last stage) returns the loss;
- ``B``: the stage's backward, on what its forward kept and the gradient the stage after sent;
  it sends the gradient of its inputs back;
- ``I`` and ``W`` (zero-bubble): ``B`` in two halves, the input gradient first (sent back at
  once) and the weight gradient later.

A program moves tensors by the ops ``zerocc.send``/``recv``/``keep``/``kept``, implemented here
against the :class:`PipelineRank` running the action: what crosses between stages goes through
its :class:`Transport`, keyed by (direction, receiving stage, micro-batch, tensor), so that any
order the schedule allows matches sends to receives; what a stage keeps stays with the rank
until the micro-batch's backward on that stage is done. :class:`LocalTransport` holds tensors
in one process: :func:`run_in_one_process` walks every rank's list there, in the order the
schedule's simulation runs them, which is how a cut and a schedule are checked against the
whole step without launching ranks.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import fx

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.parallel.pipeline_schedule import Action, PipelineSchedule
from zerocc.compiler.parallel.stage_programs import (
    Slot,
    StagedStep,
    StageProgram,
    split_backward,
    stage_model,
    step_form,
)
from zerocc.engine.watchdog import Heartbeat, wait_watched
from zerocc.errors import BatchError
from zerocc.ir.kinds import Role
from zerocc.ir.ops import implements

Key = tuple[str, int, int, str]  # (F or B, receiving stage, micro-batch, tensor)
Like = tuple[list[int], torch.dtype, torch.device]  # a received tensor's shape, dtype, device
# What runs one action's program on a micro-batch (binding its inputs), returning its output.
Runner = Callable[[int], Any]
# The value of a parameter, buffer, batch tensor or loss-scale input of a stage program, for a
# micro-batch: what the rank's state and the micro-batch hold.
Inputs = Callable[[Slot, int], torch.Tensor]


def microbatches_of(batch: tuple, microbatches: int) -> list[tuple]:
    """``batch`` cut into ``microbatches`` along the first dimension of its tensors (which must
    be one size, a multiple of ``microbatches``); other values are given to each."""
    tensors = [b for b in batch if isinstance(b, torch.Tensor) and b.dim() > 0]
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1 or next(iter(sizes)) % microbatches:
        raise BatchError(
            f"pipeline.microbatches: {microbatches} micro-batches cut each batch tensor along "
            f"its first dimension, which must be one size for all and divide by "
            f"{microbatches}; the batch's tensors are {[list(t.shape) for t in tensors]}"
        )
    size = next(iter(sizes)) // microbatches
    return [
        tuple(
            b[m * size : (m + 1) * size] if isinstance(b, torch.Tensor) and b.dim() > 0 else b
            for b in batch
        )
        for m in range(microbatches)
    ]


class Transport(Protocol):
    """How tensors reach the neighbouring stages."""

    def send(self, tensor: torch.Tensor, stage: int, key: Key) -> None:
        """Send ``tensor`` to the rank holding ``stage``."""

    def recv(self, stage: int, key: Key, like: Like) -> torch.Tensor:
        """The tensor ``key`` the rank holding ``stage`` sent (of ``like``'s shape, dtype and
        device)."""


class LocalTransport:
    """Every stage in one process: a send is held until its receive."""

    def __init__(self) -> None:
        self.held: dict[Key, torch.Tensor] = {}

    def send(self, tensor: torch.Tensor, stage: int, key: Key) -> None:
        self.held[key] = tensor

    def recv(self, stage: int, key: Key, like: Like) -> torch.Tensor:
        return self.held.pop(key)


class TorchTransport:
    """Point-to-point sends and receives of ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

    Sends are asynchronous (two neighbours send to each other at once in a 1F1B steady state),
    kept until :meth:`finish`; receives block. Every message carries a tag numbered from its
    key, the same on every rank (they cut the same step), so that a receive takes its own
    message whatever order the two ranks' schedules issue them in. ``rank_of`` gives the
    rank (in ``group``) that holds a stage. Waits are watched by ``heartbeat`` (the comm's):
    a neighbour that stops answering is named once the watch finds it silent, not after the
    group's timeout."""

    def __init__(
        self,
        staged: StagedStep,
        microbatches: int,
        rank_of: Callable[[int], int],
        group: dist.ProcessGroup | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        keys = [
            (direction, slot.peer, slot.key)
            for stage in staged.stages
            for program, direction in ((stage.forward, "F"), (stage.backward, "B"))
            for slot in program.outputs
            if slot.kind == "send"
        ]
        self.tags = {key: i * microbatches for i, key in enumerate(sorted(keys))}
        self.rank_of, self.group, self.heartbeat = rank_of, group, heartbeat
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        # gloo's sends and receives are waited for whole (see wait_watched); NCCL's wait is a
        # stream's, made on the caller's thread.
        self.on_gloo = heartbeat is not None and dist.get_backend(group) == "gloo"

    def _tag(self, key: Key) -> int:
        direction, stage, microbatch, name = key
        return self.tags[direction, stage, name] + microbatch

    def send(self, tensor: torch.Tensor, stage: int, key: Key) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, self.rank_of(stage), group=self.group, tag=self._tag(key))
        self.pending.append((work, tensor))

    def recv(self, stage: int, key: Key, like: Like) -> torch.Tensor:
        shape, dtype, device = like
        out = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(out, self.rank_of(stage), group=self.group, tag=self._tag(key))
        wait_watched(work, self.heartbeat, point_to_point=self.on_gloo)
        return out

    def finish(self) -> None:
        """Wait for every send issued (their tensors are held until then)."""
        for work, _ in self.pending:
            wait_watched(work, self.heartbeat, point_to_point=self.on_gloo)
        self.pending.clear()


@dataclass
class StepTimeline:
    """What one pipeline rank did in a step, in seconds from its first action's start:
    ``actions`` each (action, start, end, the part of it spent receiving), ``receives`` each
    (start, end, the stage it came from), ``update`` the update program's (start, end);
    ``started`` the wall clock (``time.time()``) at the first action, to line ranks up."""

    started: float = 0.0
    actions: list[tuple[Action, float, float, float]] = field(default_factory=list)
    receives: list[tuple[float, float, int]] = field(default_factory=list)
    update: tuple[float, float] = (0.0, 0.0)

    @property
    def waiting_share(self) -> float:
        """The share of the actions' span spent waiting for a neighbour."""
        span = self.actions[-1][2] if self.actions else 0.0
        return sum(waited for *_, waited in self.actions) / span if span > 0 else 0.0


class PipelineRank:
    """The stages one rank holds, run action by action: ``runners[(stage, kind)]`` runs the
    program of that stage and action kind (``F``, ``B``, ``I``, ``W``) on a micro-batch.
    While one runs, the program's ``send``/``recv``/``keep``/``kept`` ops act on this rank.
    ``losses`` holds what the last stage's forwards returned, by micro-batch."""

    def __init__(self, runners: Mapping[tuple[int, str], Runner], transport: Transport) -> None:
        self.runners, self.transport = runners, transport
        self.local = LocalTransport()  # between two stages this rank holds (ZBV's V)
        self.kept: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        # Bytes of what is kept, each storage once per (stage, micro-batch), and the most
        # held at any time: what zerocc.cost.pipeline_memory predicts.
        self._kept_storages: dict[tuple[int, int], dict[int, int]] = {}
        self.kept_bytes = self.most_kept = 0
        self.losses: dict[int, Any] = {}
        self.action: Action | None = None
        self.waited = 0.0  # seconds spent in receives (waiting for a neighbour, mostly)
        # Each receive: (its start, its end, the stage it came from), time.perf_counter()'s.
        self.receives: list[tuple[float, float, int]] = []

    def run(self, action: Action) -> None:
        """Run one action of the rank's schedule."""
        runner = self.runners.get((action.stage, action.kind))
        if runner is None:
            raise RuntimeError(f"zerocc: this pipeline rank holds no program for {action}")
        token = _RUNNING.set(self)
        self.action = action
        try:
            out = runner(action.microbatch)
        finally:
            _RUNNING.reset(token)
            self.action = None
        if action.kind == "F" and out is not None:
            self.losses[action.microbatch] = out
        if action.kind in ("B", "W"):  # the micro-batch is done with on this stage
            self.kept.pop((action.stage, action.microbatch), None)
            released = self._kept_storages.pop((action.stage, action.microbatch), {})
            self.kept_bytes -= sum(released.values())

    def _to(self, stage: int) -> Transport:
        held = any(s == stage for s, _ in self.runners)
        return self.local if held else self.transport

    def _key(self, receiver: int, name: str) -> Key:
        """The key of tensor ``name`` the running action sends to or receives at stage
        ``receiver``."""
        action = self.action
        return ("F" if action.kind == "F" else "B", receiver, action.microbatch, name)

    def send(self, tensor: torch.Tensor, stage: int, name: str) -> None:
        self._to(stage).send(tensor, stage, self._key(stage, name))

    def recv(self, like: Like, stage: int, name: str) -> torch.Tensor:
        began = time.perf_counter()
        try:
            return self._to(stage).recv(stage, self._key(self.action.stage, name), like)
        finally:
            ended = time.perf_counter()
            self.waited += ended - began
            self.receives.append((began, ended, stage))

    def keep(self, tensor: torch.Tensor, name: str) -> None:
        key = (self.action.stage, self.action.microbatch)
        self.kept.setdefault(key, {})[name] = tensor
        storages, storage = self._kept_storages.setdefault(key, {}), tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = storage.nbytes()
            self.kept_bytes += storage.nbytes()
            self.most_kept = max(self.most_kept, self.kept_bytes)

    def kept_tensor(self, name: str) -> torch.Tensor:
        return self.kept[self.action.stage, self.action.microbatch][name]


_RUNNING: contextvars.ContextVar[PipelineRank | None] = contextvars.ContextVar(
    "zerocc_pipeline_rank", default=None
)


def _running(op: str) -> PipelineRank:
    rank = _RUNNING.get()
    if rank is None:
        raise RuntimeError(f"zerocc.{op} runs only inside an action of a pipeline rank")
    return rank


@implements("send")
def _send(tensor: torch.Tensor, stage: int, name: str) -> None:
    _running("send").send(tensor, stage, name)


@implements("recv")
def _recv(shape: list[int], dtype: torch.dtype, device: torch.device, stage: int, name: str):
    return _running("recv").recv((shape, dtype, device), stage, name)


@implements("keep")
def _keep(tensor: torch.Tensor, name: str) -> None:
    _running("keep").keep(tensor, name)


@implements("kept")
def _kept(shape: list[int], dtype: torch.dtype, device: torch.device, name: str):
    return _running("kept").kept_tensor(name)


@dataclass
class CapturedRank:
    """A rank's stages as captured (before any pass), run on given parameter values: its
    :class:`PipelineRank`, and the gradients its programs return, summed over micro-batches
    (of a tied parameter, this rank's stages' part)."""

    rank: PipelineRank
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def captured_rank(
    staged: StagedStep,
    model: ModelInfo,
    stages: list[int],
    split: bool,
    transport: Transport,
    inputs: Inputs,
) -> CapturedRank:
    """The rank holding ``stages`` of ``staged`` (``split``: backward in two halves), running
    the captured programs in step form, their parameters, buffers and batch tensors bound by
    ``inputs``."""
    runners: dict[tuple[int, str], Runner] = {}
    result = CapturedRank(PipelineRank(runners, transport))
    for s in stages:
        stage = staged.stages[s]
        held = stage_model(model, stage)
        programs = {"F": stage.forward}
        if split:
            programs["I"], programs["W"] = split_backward(stage.backward)
        else:
            programs["B"] = stage.backward
        for kind, program in programs.items():
            runners[s, kind] = _runner(program, held, inputs, result.grads)
    return result


def _runner(
    program: StageProgram, held: ModelInfo, inputs: Inputs, grads: dict[str, torch.Tensor]
) -> Runner:
    gm: fx.GraphModule = step_form(program, held)
    bound = [s for s in program.inputs if s.kind not in (Role.RECEIVED, Role.STASHED)]
    trainable = [p.fqn for p in held.trainable]

    def run(microbatch: int) -> Any:
        loss, *computed = gm(*(inputs(slot, microbatch) for slot in bound))
        for fqn, grad in zip(trainable, computed, strict=True):
            if grad is not None:
                grads[fqn] = grad if fqn not in grads else grads[fqn] + grad
        return loss

    return run


def run_in_one_process(
    staged: StagedStep, model: ModelInfo, schedule: PipelineSchedule, inputs: Inputs
) -> list[CapturedRank]:
    """Every rank of ``schedule`` walked in this process, over a :class:`LocalTransport`, each
    action when the schedule's simulation starts it (so every receive follows its send)."""
    if schedule.stages != len(staged.stages):
        raise ValueError(
            f"a schedule of {schedule.stages} stages for a step cut into {len(staged.stages)}"
        )
    transport = LocalTransport()
    ranks = [
        captured_rank(staged, model, schedule.stages_of(r), schedule.splits_backward, transport,
                      inputs)
        for r in range(schedule.pp)
    ]  # fmt: skip
    spans = schedule.simulate().spans
    started = sorted(
        (start, rank, i, action)
        for rank, actions in enumerate(spans)
        for i, (action, start, _) in enumerate(actions)
    )
    for _, rank, _, action in started:
        ranks[rank].rank.run(action)
    return ranks
