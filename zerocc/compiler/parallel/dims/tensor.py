"""Tensor parallelism (``parallel.tp``): the layers the plan names are split over ``tp``
consecutive ranks, the ``tp`` groups (their activations' all-reduces and gathers run there on
every layer, forward and backward: the closest ranks). What a layer's split is, and how
capture splits it: :mod:`zerocc.compiler.parallel.tensor_parallel`.

    rank = data_rank × tp + tp_rank   (within a pipeline stage's ranks)
"""

from __future__ import annotations

from zerocc.compiler.parallel.dims.base import (
    Dimension,
    Group,
    MeshLayout,
    Ranks,
    RanksOf,
    Spread,
    some,
)
from zerocc.ir.ops import TP_GROUP as TP


def _slices(m: MeshLayout) -> Ranks:
    t = m.tp
    return [list(range(d * t, (d + 1) * t)) for d in range(m.data_parallel)]


def _index(m: MeshLayout, sizes: list[str], index: str) -> tuple[list[str], str]:
    if m.tp == 1:
        return sizes, index
    index = f"({index}) × {m.tp} + tp" if m.hybrid else f"shard × {m.tp} + tp"
    return [*sizes, f"{m.tp} tensor-parallel"], index


def _said(m: MeshLayout, groups: RanksOf) -> list[str]:
    return [f"layers split over the tp groups {some(groups(TP))}"] if m.tp > 1 else []


def _spread(m: MeshLayout, group: str, sharded: bool) -> Spread | None:
    # Each tp rank holds its slice of the split parameters (the others' it holds alike).
    return Spread(TP, "parts", "the tp ranks' slices") if m.tp > 1 else None


TENSOR = Dimension(
    name="tensor",
    degree="tp",
    field="parallel.tp",
    groups=(Group(TP, lambda m: m.tp > 1, _slices, MeshLayout.tp_rank),),
    said=_said,
    said_at=1,
    index=_index,
    spread=_spread,
)
