"""Data parallelism, ZeRO's shards and hybrid sharding (``zero.replicate``): every unit is
sharded over a ``dp`` group of ``shard_size`` data-parallel ranks, kept in ``replicate``
replicas across the ``replicate`` groups (HSDP), whose gradients are all-reduced across them
after their reduce-scatter within the group.

    data rank = replica × shard_size + shard_rank
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
from zerocc.ir.ops import DP_GROUP as DP
from zerocc.ir.ops import REPLICATE_GROUP as REPLICATE


def _shard_groups(m: MeshLayout) -> Ranks:
    s, t = m.shard_size, m.tp
    return [[(r * s + i) * t + j for i in range(s)] for r in range(m.replicate) for j in range(t)]


def _replicas(m: MeshLayout) -> Ranks:
    s, t = m.shard_size, m.tp
    return [list(range(i * t + j, m.stage_ranks, s * t)) for i in range(s) for j in range(t)]


def _index(m: MeshLayout, sizes: list[str], index: str) -> tuple[list[str], str]:
    sizes = [f"{m.replicate} replicas"] * m.hybrid + [f"{m.shard_size} shards"]
    return sizes, f"replica × {m.shard_size} + shard" if m.hybrid else "shard"


def _said(m: MeshLayout, groups: RanksOf) -> list[str]:
    said = [f"dp groups {some(groups(DP))}"]
    if m.hybrid:
        said.append(f"gradients all-reduced across the replicate groups {some(groups(REPLICATE))}")
    return said


def _spread(m: MeshLayout, group: str, sharded: bool) -> Spread | None:
    # Each rank of the shard group holds its slice of every unit's gradient (stages 1-3).
    if sharded and m.data_parallel > 1:
        return Spread(DP, "parts", "the dp ranks' slices")
    return None


DATA = Dimension(
    name="data",
    degree="replicate",
    field="zero.replicate",
    groups=(
        Group(DP, lambda m: True, _shard_groups, MeshLayout.shard_rank),
        Group(REPLICATE, lambda m: m.hybrid, _replicas, MeshLayout.replica),
    ),
    said=_said,
    said_at=0,
    index=_index,
    spread=_spread,
)
