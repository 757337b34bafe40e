"""The ranks' layout: which ranks shard a unit together and which hold replicas of a shard.

ZeRO shards each unit over every rank; hybrid sharding (HSDP, ``zero.replicate: R``) shards it
over groups of ``N / R`` ranks and keeps ``R`` replicas of every shard, whose gradients are
all-reduced across the replicas after their reduce-scatter within the group. The usual
placement puts a shard group inside a node (its all-gathers and reduce-scatters on the fast
links) and the replicas across nodes, so a shard group is ``N / R`` consecutive ranks:

    rank = replica * shard_size + shard_rank

Two named groups carry the program's collectives: ``dp`` (the shard group: all-gathers,
reduce-scatters, and the all-reduces of what every shard group computes alike, the clip's norm
and the overflow flag) and ``replicate`` (the ranks holding the same shard: the gradient
all-reduce). Without hybrid sharding ``dp`` is every rank and ``replicate`` is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerocc.errors import PlanError
from zerocc.ir.ops import DP_GROUP as DP
from zerocc.ir.ops import REPLICATE_GROUP as REPLICATE


@dataclass(frozen=True)
class Mesh:
    """``world_size`` ranks as ``replicate`` replicas of shard groups of ``shard_size``."""

    world_size: int
    replicate: int = 1

    @staticmethod
    def of(world_size: int, replicate: int) -> Mesh:
        """The layout of ``world_size`` ranks for a plan's ``zero.replicate``; a PlanError when
        the ranks cannot be split so."""
        if replicate > 1 and world_size % replicate:
            raise PlanError(
                f"zero.replicate: {replicate} does not divide the world size {world_size}; "
                f"allowed: a divisor of {world_size}"
            )
        if replicate > 1 and world_size == replicate:
            raise PlanError(
                f"zero.replicate: {replicate} leaves shard groups of one rank ({world_size} ranks):"
                " nothing would be sharded; use zero.stage: 0 (DDP) for full replicas, or a"
                f" smaller replicate (a divisor of {world_size} below it)"
            )
        return Mesh(world_size, replicate)

    @property
    def shard_size(self) -> int:
        """Ranks a unit is sharded over."""
        return self.world_size // self.replicate

    @property
    def hybrid(self) -> bool:
        """Whether shards are replicated (HSDP)."""
        return self.replicate > 1

    def shard_rank(self, rank: int) -> int:
        """Which shard of each unit ``rank`` holds."""
        return rank % self.shard_size

    def replica(self, rank: int) -> int:
        """Which replica ``rank`` belongs to."""
        return rank // self.shard_size

    def groups(self, name: str) -> list[list[int]]:
        """The ranks of every group of kind ``name`` (``dp`` or ``replicate``), each in rank
        order: what every rank creates, in this order."""
        s = self.shard_size
        if name == DP:
            return [list(range(r * s, (r + 1) * s)) for r in range(self.replicate)]
        if name == REPLICATE:
            return [list(range(i, self.world_size, s)) for i in range(s)]
        raise ValueError(f"unknown group {name!r}; known: {DP}, {REPLICATE}")

    def describe(self) -> str:
        """One line for explain() and the estimate: the layout and its groups (the first two
        of each kind, and how many there are)."""
        return (
            f"mesh: {self.world_size} ranks = {self.replicate} replicas × {self.shard_size}"
            f" shards (rank = replica × {self.shard_size} + shard); dp groups"
            f" {_some(self.groups(DP))}; gradients all-reduced across the replicate groups"
            f" {_some(self.groups(REPLICATE))}"
        )


def _some(groups: list[list[int]]) -> str:
    """``[0-3], [4-7], … (16 groups)``: a few groups of ranks, short."""

    def short(ranks: list[int]) -> str:
        if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
            return f"[{ranks[0]}-{ranks[-1]}]"
        if len(ranks) > 4:
            return f"[{ranks[0]}, {ranks[1]}, …, {ranks[-1]}]"
        return str(ranks)

    shown = ", ".join(short(g) for g in groups[:2])
    return shown if len(groups) <= 2 else f"{shown}, … ({len(groups)} groups)"


def mesh_lines(world_size: int, replicate: int) -> list[str]:
    """The layout line of a report (explain, estimate): one under hybrid sharding, else none."""
    return [Mesh.of(world_size, replicate).describe()] if replicate > 1 else []
