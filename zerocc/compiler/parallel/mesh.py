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

Expert parallelism (``parallel.ep: E``) splits each experts module's experts over groups of
``E`` consecutive data-parallel ranks, ``ep`` (the tokens' all-to-alls run there); the ranks
holding the same experts, one of each ``ep`` group, are ``edp``: the experts' units are sharded
and their gradients reduced over them (torchtitan's ``efsdp``), every other unit over ``dp``.

    data rank = block * ep + ep_rank        (edp rank = block)

A secondary partition (``zero.secondary_group: G``, ZeRO++'s hpZ) splits each shard group into
groups of ``G`` consecutive shard ranks, ``secondary`` (a node's, under the usual placement):
backward gathers a unit over them from the copy each kept of its part of forward's gather.

    shard rank = block * G + secondary rank
"""

from __future__ import annotations

from dataclasses import dataclass

from zerocc.compiler.plan import Plan, check_layout
from zerocc.ir.ops import DP_GROUP as DP
from zerocc.ir.ops import EP_GROUP as EP
from zerocc.ir.ops import EXPERT_DP_GROUP as EDP
from zerocc.ir.ops import PP_GROUP as PP
from zerocc.ir.ops import REPLICATE_GROUP as REPLICATE
from zerocc.ir.ops import SECONDARY_GROUP as SECONDARY
from zerocc.ir.ops import TIE_GROUP as TIE
from zerocc.ir.ops import TP_GROUP as TP


@dataclass(frozen=True)
class Mesh:
    """``world_size`` ranks as ``replicate`` replicas of shard groups of ``shard_size``
    data-parallel ranks, each of them ``tp`` tensor-parallel ranks; the data-parallel ranks in
    groups of ``ep`` splitting the experts; each shard group in groups of ``secondary``."""

    world_size: int
    replicate: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    secondary: int = 1

    @staticmethod
    def of(
        world_size: int,
        replicate: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        secondary: int = 1,
    ) -> Mesh:
        """The layout of ``world_size`` ranks for a plan's ``zero.replicate``,
        ``parallel.tp``, ``parallel.pp``, ``parallel.ep`` and ``zero.secondary_group``; a
        PlanError when the ranks cannot be split so."""
        check_layout(world_size, replicate, tp, pp, ep, secondary)
        return Mesh(world_size, replicate, tp, pp, ep, secondary)

    @staticmethod
    def of_plan(plan: Plan, world_size: int) -> Mesh:
        """The layout of ``world_size`` ranks under ``plan`` (``zero.replicate``,
        ``parallel``); a PlanError when the ranks cannot take it."""
        plan.check_world_size(world_size)
        parallel, zero = plan.parallel, plan.zero
        return Mesh(
            world_size, zero.replicate, parallel.tp, parallel.pp, parallel.ep,
            zero.secondary_group,
        )  # fmt: skip

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
    def expert_shard_size(self) -> int:
        """Ranks an experts unit is sharded over: those holding the same experts."""
        return self.data_parallel // self.ep

    @property
    def split(self) -> bool:
        """Whether the ranks are split into groups at all (HSDP, tensor, pipeline or expert
        parallelism, a secondary partition)."""
        return self.hybrid or self.tp > 1 or self.pp > 1 or self.ep > 1 or self.secondary > 1

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

    def ep_rank(self, rank: int) -> int:
        """Which slice of each experts module's experts ``rank`` holds."""
        return self.data_rank(rank) % self.ep

    def group_rank(self, name: str, rank: int) -> int:
        """``rank``'s place in its group of kind ``name`` (the slice or shard it holds)."""
        places = {
            DP: self.shard_rank,
            REPLICATE: self.replica,
            TP: self.tp_rank,
            EP: self.ep_rank,
            EDP: lambda r: self.data_rank(r) // self.ep,
            SECONDARY: lambda r: self.shard_rank(r) % self.secondary,
        }
        return places[name](rank)

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
        elif name == SECONDARY:  # G consecutive shard ranks of each shard group
            g = self.secondary
            stage = [
                [(r * s + b * g + i) * t + j for i in range(g)]
                for r in range(self.replicate)
                for b in range(s // g)
                for j in range(t)
            ]
        elif name in (EP, EDP):
            e, blocks = self.ep, self.data_parallel // self.ep
            at = lambda b, i, j: (b * e + i) * t + j  # noqa: E731 (data rank b × ep + i, tp j)
            if name == EP:
                stage = [[at(b, i, j) for i in range(e)] for b in range(blocks) for j in range(t)]
            else:
                stage = [[at(b, i, j) for b in range(blocks)] for i in range(e) for j in range(t)]
        else:
            known = ", ".join((DP, REPLICATE, TP, PP, TIE, EP, EDP, SECONDARY))
            raise ValueError(f"unknown group {name!r}; known: {known}")
        return [[p * n + r for r in ranks] for p in range(self.pp) for ranks in stage]

    def named_groups(self) -> list[str]:
        """The kinds of group this layout splits the ranks into, in the order they are made."""
        pipeline = [PP, TIE] if self.pp > 1 else []
        experts = [EP, EDP] if self.ep > 1 else []
        secondary = [SECONDARY] if self.secondary > 1 else []
        return (
            [DP] + [REPLICATE] * self.hybrid + [TP] * (self.tp > 1) + pipeline + experts
            + secondary
        )  # fmt: skip

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
        if self.ep > 1:
            groups.append(
                f"experts split over the ep groups {_some(self.groups(EP))}, their units "
                f"sharded over the edp groups {_some(self.groups(EDP))}"
            )
        if self.secondary > 1:
            groups.append(
                f"backward gathers stage 3's parameters over the secondary groups "
                f"{_some(self.groups(SECONDARY))} from a copy kept since forward"
            )
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
