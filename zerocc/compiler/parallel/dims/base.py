"""What a parallel dimension is: the ranks' layout every dimension reads (:class:`MeshLayout`:
the degrees and the arithmetic of a rank's place), and the record a dimension registers
(:class:`Dimension`: its degree and the plan field it is read from, its groups and each
rank's place in them, what it says of the layout, the groups over which it spreads a unit's
gradient). :mod:`zerocc.compiler.parallel.mesh` composes the registered dimensions
(:data:`zerocc.compiler.parallel.dims.DIMENSIONS`) into the :class:`Mesh`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

from zerocc.compiler.plan import Plan


@dataclass(frozen=True)
class MeshLayout:
    """``world_size`` ranks as ``pp`` pipeline stages' ranks of ``replicate`` replicas of
    shard groups of ``shard_size`` data-parallel ranks, each of them ``tp`` tensor-parallel
    ranks; the data-parallel ranks in groups of ``ep`` splitting the experts; each shard group
    in groups of ``secondary``. Its fields after ``world_size`` are the degrees: each is a
    registered dimension's (:attr:`Dimension.degree`), and only these fields spell them.

        rank = pp_rank × stage_ranks + data_rank × tp + tp_rank
        data rank = replica × shard_size + shard_rank = block × ep + ep_rank
    """

    world_size: int
    replicate: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    secondary: int = 1

    def degrees(self) -> dict[str, int]:
        """Each degree by its name (the fields after ``world_size``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)[1:]}

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (every rank without pipeline parallelism)."""
        return self.world_size // self.pp

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: how many distinct batches one step trains on."""
        return self.stage_ranks // self.tp

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

    def pp_rank(self, rank: int) -> int:
        """Which pipeline rank (which stages) ``rank`` is."""
        return rank // self.stage_ranks

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


Ranks = list[list[int]]
RanksOf = Callable[[str], Ranks]  # a mesh's groups of one kind, by name


@dataclass(frozen=True)
class Group:
    """One kind of group a dimension splits the ranks into: its name (the name a program's
    collectives give, :mod:`zerocc.ir.ops`), whether a layout makes it, its groups' ranks
    (``ranks``: within one pipeline stage's ranks, repeated for each stage, unless
    ``whole_world``: across them), and each rank's place in its group (None: a group whose
    ranks hold nothing apart)."""

    name: str
    made: Callable[[MeshLayout], bool]
    ranks: Callable[[MeshLayout], Ranks]
    place: Callable[[MeshLayout, int], int] | None = None
    whole_world: bool = False


@dataclass(frozen=True)
class Spread:
    """A group over whose ranks a unit's gradient lies in parts the optimizer's checks (the
    clip's squared norm, the non-finite flags) are summed over: ``holds`` "parts" when its
    ranks hold other elements of the same units (shards, slices, other experts), "units" when
    they hold other units (a pipeline's other stages); ``what``: its ranks, in words (the
    collective's note)."""

    group: str
    holds: Literal["parts", "units"]
    what: str


@dataclass(frozen=True)
class Dimension:
    """A parallel dimension, registered in :data:`zerocc.compiler.parallel.dims.DIMENSIONS`:

    - ``degree``: the :class:`MeshLayout` field it sets, read from the plan at ``field`` (its
      plan path, :meth:`read`); its plan checks sit beside that field
      (:mod:`zerocc.compiler.plan.parallelism`, :func:`~zerocc.compiler.plan.check_layout`);
    - ``groups``: the groups it makes, in the order every rank creates them;
    - ``index``: the layout line's sizes and rank formula with this dimension
      (``(sizes, index) -> (sizes, index)``); ``said``: its groups in words (given the mesh's
      ``groups``), at ``said_at`` (the layout line's order);
    - ``spread``: the group over which it spreads a unit's gradient (the unit's group, whether
      ZeRO shards the optimizer), if any;
    - ``shapes_state``: whether its degree changes what a rank's state holds (its shards,
      slices, stages, experts): a rank's checkpoint records it and loads only under the same
      (:mod:`zerocc.runtime.checkpoint.rank_state`).
    """

    name: str
    degree: str
    field: str
    groups: tuple[Group, ...]
    said: Callable[[MeshLayout, RanksOf], list[str]]  # (the layout, its groups by name)
    said_at: int
    index: Callable[[MeshLayout, list[str], str], tuple[list[str], str]] = (
        lambda layout, sizes, index: (sizes, index)
    )
    spread: Callable[[MeshLayout, str, bool], Spread | None] = lambda layout, group, sharded: None
    shapes_state: bool = True

    def read(self, plan: Plan) -> int:
        """The degree ``plan`` sets at :attr:`field`."""
        section, name = self.field.split(".")
        return getattr(getattr(plan, section), name)


def some(groups: Ranks) -> str:
    """``[0-3], [4-7], … (16 groups)``: a few groups of ranks, short."""

    def short(ranks: list[int]) -> str:
        if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
            return f"[{ranks[0]}-{ranks[-1]}]"
        if len(ranks) > 4:
            return f"[{ranks[0]}, {ranks[1]}, …, {ranks[-1]}]"
        return str(ranks)

    shown = ", ".join(short(g) for g in groups[:2])
    return shown if len(groups) <= 2 else f"{shown}, … ({len(groups)} groups)"
