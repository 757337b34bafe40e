"""The ranks' layout: which ranks shard a unit together, which hold replicas of a shard, and
which split a layer by tensor parallelism.

ZeRO shards each unit over the data-parallel ranks; hybrid sharding (HSDP,
``zero.replicate: R``) shards it over groups of ``D / R`` of them and keeps ``R`` replicas of
every shard, whose gradients are all-reduced across the replicas after their reduce-scatter
within the group. Tensor parallelism (``parallel.tp: T``) splits the layers the plan names over
``T`` ranks, each of which holds its own slice of those weights, so the ``N`` ranks are
``D = N / T`` data-parallel ranks of ``T`` tensor-parallel ranks each. The usual placement puts
the tensor-parallel ranks (collectives on every layer, in forward and backward) closest
together, then a shard group (all-gathers and reduce-scatters) inside a node, and the replicas
across nodes:

    rank = (replica * shard_size + shard_rank) * tp + tp_rank

Three named groups carry the program's collectives: ``dp`` (the shard group: all-gathers,
reduce-scatters, and the all-reduces of what every shard group computes alike, the clip's norm
and the overflow flag), ``replicate`` (the ranks holding the same shard: the gradient all-reduce)
and ``tp`` (the ranks splitting a layer: its activations' all-reduces and gathers). Without
hybrid sharding or tensor parallelism, ``dp`` is every rank and the others are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerocc.compiler.plan import Plan, check_layout
from zerocc.ir.ops import DP_GROUP as DP
from zerocc.ir.ops import PP_GROUP as PP
from zerocc.ir.ops import REPLICATE_GROUP as REPLICATE
from zerocc.ir.ops import TIE_GROUP as TIE
from zerocc.ir.ops import TP_GROUP as TP


@dataclass(frozen=True)
class Mesh:
    """``world_size`` ranks as ``replicate`` replicas of shard groups of ``shard_size``
    data-parallel ranks, each of them ``tp`` tensor-parallel ranks."""

    world_size: int
    replicate: int = 1
    tp: int = 1
    pp: int = 1

    @staticmethod
    def of(world_size: int, replicate: int = 1, tp: int = 1, pp: int = 1) -> Mesh:
        """The layout of ``world_size`` ranks for a plan's ``zero.replicate``,
        ``parallel.tp`` and ``parallel.pp``; a PlanError when the ranks cannot be split so."""
        check_layout(world_size, replicate, tp, pp)
        return Mesh(world_size, replicate, tp, pp)

    @staticmethod
    def of_plan(plan: Plan, world_size: int) -> Mesh:
        """The layout of ``world_size`` ranks under ``plan`` (``zero.replicate``,
        ``parallel``); a PlanError when the ranks cannot take it."""
        plan.check_world_size(world_size)
        return Mesh(world_size, plan.zero.replicate, plan.parallel.tp, plan.parallel.pp)

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (every rank without pipeline parallelism)."""
        return self.world_size // self.pp

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: how many distinct batches one step trains on."""
        return self.stage_ranks // self.tp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline rank (which stages) ``rank`` is."""
        return rank // self.stage_ranks

    @property
    def shard_size(self) -> int:
        """Ranks a unit is sharded over."""
        return self.data_parallel // self.replicate

    @property
    def hybrid(self) -> bool:
        """Whether shards are replicated (HSDP)."""
        return self.replicate > 1

    @property
    def split(self) -> bool:
        """Whether the ranks are split into groups at all (HSDP, tensor or pipeline
        parallelism)."""
        return self.hybrid or self.tp > 1 or self.pp > 1

    def data_rank(self, rank: int) -> int:
        """Which data-parallel rank ``rank`` is (whose batch it trains on: the ranks of one
        pipeline share it)."""
        return rank % self.stage_ranks // self.tp

    def shard_rank(self, rank: int) -> int:
        """Which shard of each unit ``rank`` holds."""
        return self.data_rank(rank) % self.shard_size

    def replica(self, rank: int) -> int:
        """Which replica ``rank`` belongs to."""
        return self.data_rank(rank) // self.shard_size

    def tp_rank(self, rank: int) -> int:
        """Which slice of each tensor-parallel layer ``rank`` holds."""
        return rank % self.tp

    def groups(self, name: str) -> list[list[int]]:
        """The ranks of every group of kind ``name`` (``dp``, ``replicate``, ``tp`` or
        ``pp``), each in rank order: what every rank creates, in this order."""
        s, t, n = self.shard_size, self.tp, self.stage_ranks
        if name == PP:
            return [list(range(i, self.world_size, n)) for i in range(n)]
        if name == TIE:  # a pipeline's first and last ranks (a tied embedding and head)
            return [[ranks[0], ranks[-1]] for ranks in self.groups(PP)]
        if name == DP:
            stage = [
                [(r * s + i) * t + j for i in range(s)]
                for r in range(self.replicate)
                for j in range(t)
            ]
        elif name == REPLICATE:
            stage = [list(range(i * t + j, n, s * t)) for i in range(s) for j in range(t)]
        elif name == TP:
            stage = [list(range(d * t, (d + 1) * t)) for d in range(self.data_parallel)]
        else:
            known = ", ".join((DP, REPLICATE, TP, PP, TIE))
            raise ValueError(f"unknown group {name!r}; known: {known}")
        return [[p * n + r for r in ranks] for p in range(self.pp) for ranks in stage]

    def named_groups(self) -> list[str]:
        """The kinds of group this layout splits the ranks into, in the order they are made."""
        pipeline = [PP, TIE] if self.pp > 1 else []
        return [DP] + [REPLICATE] * self.hybrid + [TP] * (self.tp > 1) + pipeline

    def describe(self) -> str:
        """One line for explain() and the estimate: the layout and its groups (the first two
        of each kind, and how many there are)."""
        sizes = [f"{self.replicate} replicas"] * self.hybrid + [f"{self.shard_size} shards"]
        index = f"replica × {self.shard_size} + shard" if self.hybrid else "shard"
        if self.tp > 1:
            sizes.append(f"{self.tp} tensor-parallel")
            index = f"({index}) × {self.tp} + tp" if self.hybrid else f"shard × {self.tp} + tp"
        groups = [f"dp groups {_some(self.groups(DP))}"]
        if self.hybrid:
            groups.append(
                f"gradients all-reduced across the replicate groups {_some(self.groups(REPLICATE))}"
            )
        if self.tp > 1:
            groups.append(f"layers split over the tp groups {_some(self.groups(TP))}")
        if self.pp > 1:
            sizes.insert(0, f"{self.pp} pipeline stages' ranks")
            index = f"pp × {self.stage_ranks} + {index}"
            groups.append(f"stages chained over the pp groups {_some(self.groups(PP))}")
        return (
            f"mesh: {self.world_size} ranks = {' × '.join(sizes)} (rank = {index});"
            f" {'; '.join(groups)}"
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


def mesh_lines(mesh: Mesh) -> list[str]:
    """The layout line of a report (explain, estimate): one when the ranks are split into
    groups (hybrid sharding, tensor parallelism), else none."""
    return [mesh.describe()] if mesh.split else []
