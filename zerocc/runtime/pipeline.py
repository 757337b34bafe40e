"""One pipeline rank's part of a training step: walk its schedule's actions, running the stage
programs they name (issue 47).

The stage programs come from the stage cut (:mod:`zerocc.compiler.parallel.stage_cut`) and the
order from a schedule (:mod:`zerocc.compiler.parallel.pipeline_schedule`). For each action of
its list a rank runs one program on one micro-batch:

- ``F``: the stage's forward, on the activations the stage before sent (the batch, for the
  first); it sends its own on, keeps what its backward reads, and (last stage) the loss;
- ``B``: the stage's backward, on what its forward kept and the gradient the stage after sent;
  it sends the gradient of its inputs back and adds its parameters' gradients to the step's;
- ``I`` and ``W`` (zero-bubble): ``B`` in two halves, the input gradient first (sent back at
  once) and the weight gradient later.

What crosses between stages goes through a :class:`Transport`, keyed by (direction, receiving
stage, micro-batch, tensor), so that any order the schedule allows matches sends to receives.
:class:`LocalTransport` holds them in one process: :func:`run_in_one_process` walks every
rank's list there, in the order the schedule's simulation runs them, which is how a cut and a
schedule are checked against the whole step without launching ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from zerocc.compiler.parallel.pipeline_schedule import Action, PipelineSchedule
from zerocc.compiler.parallel.stage_cut import Slot, Stage, StagedStep, StageProgram, split_backward
from zerocc.ir.kinds import Role

Key = tuple[str, int, int, str]  # (F or B, receiving stage, micro-batch, tensor)
# The value of a parameter, buffer, batch tensor or loss-scale input of a stage program, for a
# micro-batch: what the rank's state and the micro-batch hold.
Inputs = Callable[[Slot, int], torch.Tensor]


class Transport(Protocol):
    """How tensors reach the neighbouring stages."""

    def send(self, tensor: torch.Tensor, stage: int, key: Key) -> None:
        """Send ``tensor`` to the rank holding ``stage``."""

    def recv(self, stage: int, key: Key, slot: Slot) -> torch.Tensor:
        """The tensor ``key`` the rank holding ``stage`` sent (of ``slot``'s shape and dtype)."""


class LocalTransport:
    """Every stage in one process: a send is held until its receive."""

    def __init__(self) -> None:
        self.held: dict[Key, torch.Tensor] = {}

    def send(self, tensor: torch.Tensor, stage: int, key: Key) -> None:
        self.held[key] = tensor

    def recv(self, stage: int, key: Key, slot: Slot) -> torch.Tensor:
        return self.held.pop(key)


class TorchTransport:
    """Point-to-point sends and receives of ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

    Sends are asynchronous (two neighbours send to each other at once in a 1F1B steady state),
    kept until :meth:`finish`; receives block. Every message carries a tag numbered from its
    key, the same on every rank (they cut the same step), so that a receive takes its own
    message whatever order the two ranks' schedules issue them in. ``rank_of`` gives the
    rank (in ``group``) that holds a stage."""

    def __init__(
        self,
        staged: StagedStep,
        microbatches: int,
        rank_of: Callable[[int], int],
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        keys = [
            (direction, peer, slot.key)
            for stage in staged.stages
            for program, direction, peer in (
                (stage.forward, "F", stage.index + 1),
                (stage.backward, "B", stage.index - 1),
            )
            for slot in program.outputs
            if slot.kind == "send"
        ]
        self.tags = {key: i * microbatches for i, key in enumerate(sorted(keys))}
        self.rank_of, self.group = rank_of, group
        self.device = device or torch.device("cpu")
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _tag(self, key: Key) -> int:
        direction, stage, microbatch, name = key
        return self.tags[direction, stage, name] + microbatch

    def send(self, tensor: torch.Tensor, stage: int, key: Key) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, self.rank_of(stage), group=self.group, tag=self._tag(key))
        self.pending.append((work, tensor))

    def recv(self, stage: int, key: Key, slot: Slot) -> torch.Tensor:
        out = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
        dist.recv(out, self.rank_of(stage), group=self.group, tag=self._tag(key))
        return out

    def finish(self) -> None:
        """Wait for every send issued (their tensors are held until then)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


@dataclass
class StagePrograms:
    """The programs one stage runs: forward and backward, or the backward's two halves."""

    forward: StageProgram
    backward: StageProgram | None
    input_grad: StageProgram | None = None
    weight_grad: StageProgram | None = None

    @classmethod
    def of(cls, stage: Stage, split: bool) -> StagePrograms:
        """``stage``'s programs, its backward split in two when ``split``."""
        if not split:
            return cls(stage.forward, stage.backward)
        return cls(stage.forward, None, *split_backward(stage.backward))


class PipelineRank:
    """The stages one rank holds, run action by action. After its last action, ``losses``
    holds each micro-batch's loss (on the rank of the last stage) and ``grads`` the sum over
    micro-batches of each parameter's gradient the rank computed (a tied parameter's: this
    rank's stages' part)."""

    def __init__(
        self,
        programs: dict[int, StagePrograms],
        stages: int,
        transport: Transport,
        inputs: Inputs,
    ) -> None:
        self.programs, self.stages = programs, stages
        self.transport, self.inputs = transport, inputs
        self.local = LocalTransport()  # between two stages this rank holds (ZBV's V)
        self.kept: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}

    def run(self, action: Action) -> None:
        """Run one action of the rank's schedule."""
        programs = self.programs[action.stage]
        program = {
            "F": programs.forward,
            "B": programs.backward,
            "I": programs.input_grad,
            "W": programs.weight_grad,
        }[action.kind]
        if program is None:
            raise RuntimeError(f"zerocc: stage {action.stage} has no program for {action}")
        place = (action.stage, action.microbatch)
        kept = self.kept.setdefault(place, {})
        outputs = program.gm(*(self._input(slot, action, kept) for slot in program.inputs))
        for slot, value in zip(program.outputs, outputs, strict=True):
            self._output(slot, value, action, kept)
        if action.kind in ("B", "W"):
            del self.kept[place]  # the micro-batch is done with on this stage

    def _to(self, stage: int) -> Transport:
        return self.local if stage in self.programs else self.transport

    def _input(self, slot: Slot, action: Action, kept: dict[str, torch.Tensor]) -> torch.Tensor:
        if slot.kind == Role.STASHED:
            return kept[slot.key]
        if slot.kind == Role.RECEIVED:
            forward = action.kind == "F"
            peer = action.stage - 1 if forward else action.stage + 1
            key = ("F" if forward else "B", action.stage, action.microbatch, slot.key)
            value = self._to(peer).recv(peer, key, slot)
            if action.kind == "F":
                kept[slot.key] = value  # the stage's backward reads what it received too
            return value
        return self.inputs(slot, action.microbatch)

    def _output(
        self, slot: Slot, value: torch.Tensor, action: Action, kept: dict[str, torch.Tensor]
    ) -> None:
        if slot.kind == "send":
            peer = action.stage + 1 if action.kind == "F" else action.stage - 1
            direction = "F" if action.kind == "F" else "B"
            self._to(peer).send(value, peer, (direction, peer, action.microbatch, slot.key))
        elif slot.kind == "stash":
            kept[slot.key] = value
        elif slot.kind == "loss":
            self.losses[action.microbatch] = value
        else:
            held = self.grads.get(slot.key)
            self.grads[slot.key] = value if held is None else held + value


def run_in_one_process(
    staged: StagedStep, schedule: PipelineSchedule, inputs: Inputs
) -> list[PipelineRank]:
    """Every rank of ``schedule`` walked in this process, over a :class:`LocalTransport`, each
    action when the schedule's simulation starts it (so every receive follows its send)."""
    if schedule.stages != len(staged.stages):
        raise ValueError(
            f"a schedule of {schedule.stages} stages for a step cut into {len(staged.stages)}"
        )
    split = any(a.kind == "I" for actions in schedule.actions for a in actions)
    transport = LocalTransport()
    ranks = [
        PipelineRank(
            {s: StagePrograms.of(staged.stages[s], split) for s in range(schedule.stages)
             if schedule.rank_of(s) == r},
            schedule.stages,
            transport,
            inputs,
        )
        for r in range(schedule.pp)
    ]  # fmt: skip
    spans = schedule.simulate().spans
    started = sorted(
        (start, rank, i, action)
        for rank, actions in enumerate(spans)
        for i, (action, start, _) in enumerate(actions)
    )
    for _, rank, _, action in started:
        ranks[rank].run(action)
    return ranks
