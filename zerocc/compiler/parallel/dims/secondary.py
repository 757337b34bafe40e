"""The secondary partition (``zero.secondary_group: G``, ZeRO++'s hpZ): each shard group split
into groups of ``G`` consecutive shard ranks, ``secondary`` (a node's, under the usual
placement): backward gathers a unit over them from the copy each kept of its part of
forward's gather (:mod:`zerocc.compiler.passes.shard`).

    shard rank = block × G + secondary rank
"""

from __future__ import annotations

from zerocc.compiler.parallel.dims.base import Dimension, Group, MeshLayout, Ranks, RanksOf, some
from zerocc.ir.ops import SECONDARY_GROUP as SECONDARY


def _blocks(m: MeshLayout) -> Ranks:
    g, s, t = m.secondary, m.shard_size, m.tp
    return [
        [(r * s + b * g + i) * t + j for i in range(g)]
        for r in range(m.replicate)
        for b in range(s // g)
        for j in range(t)
    ]


def _said(m: MeshLayout, groups: RanksOf) -> list[str]:
    if m.secondary == 1:
        return []
    return [
        f"backward gathers stage 3's parameters over the secondary groups "
        f"{some(groups(SECONDARY))} from a copy kept since forward"
    ]


SECONDARY_PARTITION = Dimension(
    name="secondary",
    degree="secondary",
    field="zero.secondary_group",
    groups=(
        Group(
            SECONDARY,
            lambda m: m.secondary > 1,
            _blocks,
            lambda m, r: m.shard_rank(r) % m.secondary,
        ),
    ),
    said=_said,
    said_at=3,
    shapes_state=False,  # a copy of forward's gather kept in the step: no state of its own
)
