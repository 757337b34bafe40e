"""Expert parallelism (``parallel.ep``): each experts module's experts are split over groups
of ``ep`` consecutive data-parallel ranks, ``ep`` (the tokens' all-to-alls run there); the
ranks holding the same experts, one of each ``ep`` group, are ``edp``: the experts' units are
sharded and their gradients reduced over them (torchtitan's ``efsdp``), every other unit over
``dp``. How an experts module is split and captured: :mod:`zerocc.compiler.parallel.experts`.

    data rank = block × ep + ep_rank        (edp rank = block)
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
from zerocc.ir.ops import EP_GROUP as EP
from zerocc.ir.ops import EXPERT_DP_GROUP as EDP
from zerocc.ir.ops import REPLICATE_GROUP as REPLICATE


def _at(m: MeshLayout, block: int, i: int, j: int) -> int:
    return (block * m.ep + i) * m.tp + j  # data rank block × ep + i, tp rank j


def _experts(m: MeshLayout) -> Ranks:
    blocks = m.data_parallel // m.ep
    return [[_at(m, b, i, j) for i in range(m.ep)] for b in range(blocks) for j in range(m.tp)]


def _holders(m: MeshLayout) -> Ranks:
    blocks = m.data_parallel // m.ep
    return [[_at(m, b, i, j) for b in range(blocks)] for i in range(m.ep) for j in range(m.tp)]


def _said(m: MeshLayout, groups: RanksOf) -> list[str]:
    if m.ep == 1:
        return []
    return [
        f"experts split over the ep groups {some(groups(EP))}, their units sharded over the "
        f"edp groups {some(groups(EDP))}"
    ]


def _spread(m: MeshLayout, group: str, sharded: bool) -> Spread | None:
    # An experts unit's gradient lies beyond the dp group (what the checks are summed over
    # for every unit): under hybrid sharding its shards on the other replicas' ranks; at
    # stage 0 (nothing summed over dp) the other experts, on the other ep ranks.
    if group != EDP or (sharded and not m.hybrid):
        return None
    if sharded:
        return Spread(REPLICATE, "parts", "the experts' shards on the other replicas")
    return Spread(EP, "parts", "the other ep ranks' experts")


EXPERT = Dimension(
    name="expert",
    degree="ep",
    field="parallel.ep",
    groups=(
        Group(EP, lambda m: m.ep > 1, _experts, MeshLayout.ep_rank),
        Group(EDP, lambda m: m.ep > 1, _holders, lambda m, r: m.data_rank(r) // m.ep),
    ),
    said=_said,
    said_at=2,
    spread=_spread,
)
