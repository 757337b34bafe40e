"""A pipeline rank's device memory, predicted by walking its schedule.

Three parts. The rank's **model states** (its stages' units, sharded as the plan says) are held
throughout. Each stage's forward **keeps** tensors for its backward (``zerocc.keep``), one set
per micro-batch; they are held from that forward until the micro-batch's backward (``B``, or
the weight-gradient half ``W`` of a zero-bubble schedule: its input-gradient half ``I`` keeps
what ``W`` reads) has run on the stage, so a schedule's order sets how many micro-batches' sets
are in flight: GPipe all ``M``, 1F1B at most ``pp - rank``. The running program's own
**transients** come on top (:func:`~zerocc.cost.memory.predict_memory` of it, without model
states: its kept tensors are counted as kept, not twice). A tensor sent to a neighbour is held
until it is received, at most one action longer; not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from zerocc.compiler.parallel.pipeline_schedule import Action
from zerocc.cost.memory import predict_memory, storage_id, tensors_in
from zerocc.ir.nodes import val
from zerocc.ir.quantities import human_bytes

Programs = Mapping[tuple[int, str], fx.GraphModule | None]  # (stage, kind) -> its program


@dataclass(frozen=True)
class PipelineMemory:
    """A pipeline rank's predicted device peak and what made it."""

    peak: int  # bytes at the worst action: model states + kept + the action's transients
    model_states: int
    kept: int  # of the peak: tensors kept for backward
    in_flight: int  # of the peak: the forwards (stage, micro-batch) whose kept tensors were held
    at: Action | None  # the action running at the peak
    most_kept: int = 0  # the most bytes kept at any time (after an action that keeps)

    def format(self) -> str:
        """One line for explain and the estimate."""
        where = f" at {self.at}" if self.at is not None else ""
        return (
            f"predicted peak {human_bytes(self.peak)}{where}: model states "
            f"{human_bytes(self.model_states)}, kept for backward {human_bytes(self.kept)} "
            f"({self.in_flight} forward(s) awaiting backward), the rest the running program's"
        )


def kept_bytes(gm: fx.GraphModule | None) -> int:
    """Bytes a program keeps for a later one (its ``keep`` ops' tensors, each storage once;
    what it re-keeps of what it read with ``kept`` is already held)."""
    if gm is None:
        return 0
    keep, kept = torch.ops.zerocc.keep.default, torch.ops.zerocc.kept.default
    storages: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.target is not keep or getattr(node.args[0], "target", None) is kept:
            continue
        for t in tensors_in(val(node.args[0])):
            storages[storage_id(t)] = t.untyped_storage().nbytes()
    return sum(storages.values())


def predict_pipeline_memory(
    actions: Sequence[Action], programs: Programs, model_states: int, *, gloo: bool = False
) -> PipelineMemory:
    """Walk one rank's ``actions`` in order: before each, what is held (model states and the
    tensors kept by earlier actions not yet released) plus the action's program's transient
    peak (``gloo``: its collectives' buffers on gloo counted, see
    :func:`zerocc.cost.memory.predict_memory`); the highest of these is the rank's peak."""
    transient = {
        key: predict_memory(gm, {}, gloo=gloo).peak()[1] if gm is not None else 0
        for key, gm in programs.items()
    }
    keeps = {key: kept_bytes(gm) for key, gm in programs.items()}
    held: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> kept bytes
    best = PipelineMemory(model_states, model_states, 0, 0, None)
    kept = most_kept = 0  # bytes held, and the most at any time
    for action in actions:
        key, mine = (action.stage, action.kind), (action.stage, action.microbatch)
        now = model_states + kept + transient.get(key, 0)
        if now > best.peak:
            best = PipelineMemory(now, model_states, kept, len(held), action)
        if action.kind in ("F", "I"):
            held[mine] = held.get(mine, 0) + keeps.get(key, 0)
            kept += keeps.get(key, 0)
            most_kept = max(most_kept, kept)
        else:  # B, W: the micro-batch is done with on this stage
            kept -= held.pop(mine, 0)
    return dataclasses.replace(best, most_kept=most_kept)
