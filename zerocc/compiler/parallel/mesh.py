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

Each dimension is a module of :mod:`zerocc.compiler.parallel.dims` (its degree and plan field,
its groups and each rank's place in them, what the layout line says of it, the groups over
which it spreads a unit's gradient); the :class:`Mesh` composes them in the order they are
registered. It is computed once per run, from the plan and the world size
(:func:`zerocc.compiler.driver.session.plan_mesh`), and passed to whoever needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerocc.compiler.parallel.dims import DIMENSIONS, Group, MeshLayout, Spread
from zerocc.compiler.plan import Plan, check_layout

_GROUPS: dict[str, Group] = {g.name: g for d in DIMENSIONS for g in d.groups}


@dataclass(frozen=True)
class Mesh(MeshLayout):
    """``world_size`` ranks as ``replicate`` replicas of shard groups of ``shard_size``
    data-parallel ranks, each of them ``tp`` tensor-parallel ranks; the data-parallel ranks in
    groups of ``ep`` splitting the experts; each shard group in groups of ``secondary``
    (:class:`~zerocc.compiler.parallel.dims.MeshLayout`: the degrees and a rank's place); its
    groups are the registered dimensions' (:data:`~zerocc.compiler.parallel.dims.DIMENSIONS`).
    """

    @staticmethod
    def of(world_size: int, *degrees: int, **named: int) -> Mesh:
        """The layout of ``world_size`` ranks for the degrees given (in the order of
        :class:`MeshLayout`'s fields: ``replicate``, ``tp``, ``pp``, ``ep``, ``secondary``, or
        by name); a PlanError when the ranks cannot be split so."""
        mesh = Mesh(world_size, *degrees, **named)
        check_layout(world_size, **mesh.degrees())
        return mesh

    @staticmethod
    def of_plan(plan: Plan, world_size: int) -> Mesh:
        """The layout of ``world_size`` ranks under ``plan`` (each dimension's degree, read
        from its plan field); a PlanError when the ranks cannot take it. Called at one site
        (:func:`zerocc.compiler.driver.session.plan_mesh`): take the session's mesh."""
        plan.check_world_size(world_size)
        return Mesh(world_size, **{d.degree: d.read(plan) for d in DIMENSIONS})

    @property
    def split(self) -> bool:
        """Whether the ranks are split into groups at all (HSDP, tensor, pipeline or expert
        parallelism, a secondary partition)."""
        return any(degree > 1 for degree in self.degrees().values())

    def group_rank(self, name: str, rank: int) -> int:
        """``rank``'s place in its group of kind ``name`` (the slice or shard it holds)."""
        place = _group(name).place
        if place is None:
            raise ValueError(f"the {name} groups' ranks hold nothing apart: no place in them")
        return place(self, rank)

    def groups(self, name: str) -> list[list[int]]:
        """The ranks of every group of kind ``name`` (``dp``, ``replicate``, ``tp``, ``pp``,
        ...), each in rank order: what every rank creates, in this order."""
        group = _group(name)
        if group.whole_world:
            return group.ranks(self)
        n = self.stage_ranks  # a stage's groups, the same in every pipeline stage's ranks
        return [[p * n + r for r in ranks] for p in range(self.pp) for ranks in group.ranks(self)]

    def named_groups(self) -> list[str]:
        """The kinds of group this layout splits the ranks into, in the order they are made."""
        return [g.name for d in DIMENSIONS for g in d.groups if g.made(self)]

    def gradient_groups(self, unit_group: str, shards_optimizer: bool) -> tuple[Spread, ...]:
        """The groups over whose ranks the gradient of a unit sharded over ``unit_group``
        (``dp``, or ``edp`` for an experts unit) lies in parts, ZeRO sharding the optimizer's
        state or not (``shards_optimizer``): what the optimizer's checks (the clip's squared
        norm, the non-finite flags) are summed over, so that every rank sees the whole
        model's (each dimension's :attr:`~zerocc.compiler.parallel.dims.Dimension.spread`)."""
        spreads = (d.spread(self, unit_group, shards_optimizer) for d in DIMENSIONS)
        return tuple(s for s in spreads if s is not None)

    def describe(self) -> str:
        """One line for explain() and the estimate: the layout and its groups (the first two
        of each kind, and how many there are)."""
        sizes: list[str] = []
        index = ""
        for d in DIMENSIONS:
            sizes, index = d.index(self, sizes, index)
        said = [line for d in sorted(DIMENSIONS, key=lambda d: d.said_at)
                for line in d.said(self, self.groups)]  # fmt: skip
        return (
            f"mesh: {self.world_size} ranks = {' × '.join(sizes)} (rank = {index});"
            f" {'; '.join(said)}"
        )


def _group(name: str) -> Group:
    """The registered group of kind ``name``; ValueError naming the known ones."""
    if name not in _GROUPS:
        raise ValueError(f"unknown group {name!r}; known: {', '.join(_GROUPS)}")
    return _GROUPS[name]


def mesh_lines(mesh: Mesh) -> list[str]:
    """The layout line of a report (explain, estimate): one when the ranks are split into
    groups (hybrid sharding, tensor parallelism), else none."""
    return [mesh.describe()] if mesh.split else []
