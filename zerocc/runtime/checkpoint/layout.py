"""Where a checkpoint's logical tensors sit in a step's flat, sharded states.

A checkpoint names tensors as the model does: ``model/<fqn>`` for weights (and buffers),
``optim/<fqn>/<state>`` for optimizer states (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``),
each with its full logical shape and saved as its flattened elements. A step keeps them in
flat per-unit buffers: a unit's parameters concatenated and padded to a multiple of the world
size, each rank holding the whole flat (stage 0, and the parameters of stages 1-2) or its
shard. A :class:`Piece` is where elements of one logical tensor sit in one such flat: saving
writes the pieces of a rank's range, loading fills the pieces of the range a rank needs, under
whatever units, world size and stage the loading step has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from zerocc.compiler.state import StateLayout, StateSpec
from zerocc.compiler.units import Unit, UnitParam

STEP_TENSOR = "optim/step"


def weight_name(fqn: str) -> str:
    return f"model/{fqn}"


def optim_name(fqn: str, state: str) -> str:
    return f"optim/{fqn}/{state}"


def rng_name(rank: int, device_type: str) -> str:
    return f"rng/{rank}/{device_type}"


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of a logical tensor's flattened elements, held at
    ``[at, at + stop - start)`` of a flat state."""

    param: UnitParam
    start: int
    stop: int
    at: int


@dataclass(frozen=True)
class FlatState:
    """One of a unit's flat states and the logical tensors it holds: the weights (``master``
    when the unit has one, else ``param``) or an optimizer state."""

    spec: StateSpec
    unit: Unit
    state: str  # "weights", or the optimizer state's name

    @property
    def sharded(self) -> bool:
        return self.spec.shape[0] != self.unit.padded_numel

    def name(self, param: UnitParam) -> str:
        if self.state == "weights":
            return weight_name(param.fqn)
        return optim_name(param.fqn, self.state)

    def pieces(self, rank: int, whole: bool = False) -> list[Piece]:
        """The pieces of this rank's range of the unit's padded flat: its shard's (what it
        saves: every rank saves a different shard, also of a replicated flat), or with
        ``whole`` every element its state holds (what it loads)."""
        size = self.unit.shard_numel
        if whole and not self.sharded:
            lo, hi = 0, self.unit.padded_numel
        else:
            lo, hi = rank * size, (rank + 1) * size
        base = rank * size if self.sharded else 0
        pieces = []
        for p in self.unit.params:
            start, stop = max(lo, p.offset), min(hi, p.offset + p.numel)
            if start < stop:
                pieces.append(Piece(p, start - p.offset, stop - p.offset, start - base))
        return pieces


def saved_states(
    units: list[Unit], layout: StateLayout, optim: tuple[str, ...]
) -> Iterator[FlatState]:
    """What a step saves of each unit: the weights (the fp32 masters under mixed precision,
    else the parameters) and, for a trainable unit, its optimizer states."""
    for unit in units:
        specs = layout.of_unit(unit)
        yield FlatState(specs.get("master", specs["param"]), unit, "weights")
        if unit.trainable:
            yield from (FlatState(specs[s], unit, s) for s in optim if s in specs)


def loaded_states(
    units: list[Unit], layout: StateLayout, optim: tuple[str, ...]
) -> Iterator[FlatState]:
    """What a step loads into: as saved, and the compute copy ``param`` from the weights too
    where the unit also keeps masters."""
    for flat in saved_states(units, layout, optim):
        yield flat
        if flat.state == "weights" and flat.spec.key.endswith(".master"):
            yield FlatState(layout.of_unit(flat.unit)["param"], flat.unit, "weights")
