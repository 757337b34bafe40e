"""Which storages each node of a program reads and writes: what a scheduling pass may not
reorder.

Every tensor value belongs to one *storage root*: the node that allocated it, or the placeholder
the runtime binds. Views, in-place ops and ``wait`` return an alias of an argument (their schemas
say which), so they share that argument's root; so does a getitem of a list of views
(``split``). Stages 1-2 bind a unit's ``param_shard`` placeholder to a view of its
``param_full``: both are one root. A node *reads* the roots of its tensor inputs and *writes*
the roots of the arguments its schema marks mutable (and a training batch norm its running
statistics, which its schema does not mark); a node that allocates also writes its own root
(it defines it).

A collective is in flight from its start to its wait: during that span it reads its inputs and
writes its output, so :func:`collective_access` charges both to the pair.
"""

from __future__ import annotations

import bisect
import functools
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from zerocc.ir.nodes import PARAM_FULL, PARAM_SHARD, info

aten = torch.ops.aten


@dataclass(frozen=True)
class Access:
    """Storage roots a node (or a group of nodes moved together) reads and writes."""

    reads: frozenset[fx.Node] = field(default_factory=frozenset)
    writes: frozenset[fx.Node] = field(default_factory=frozenset)

    def __or__(self, other: Access) -> Access:
        return Access(self.reads | other.reads, self.writes | other.writes)

    def conflicts(self, other: Access) -> bool:
        """Whether swapping the two would change what either sees (write-read, read-write or
        write-write on one root)."""
        return bool(self.writes & (other.reads | other.writes) or other.writes & self.reads)


class _Roots(dict):
    """Each node's storage root, found the first time it is asked for (and remembered for the
    nodes on the way): the node itself, the root of the argument its result aliases, or for a
    parameter shard (stages 1-2) the full parameter it is a view of."""

    def __init__(self, full_of: dict[str | None, fx.Node]) -> None:
        super().__init__()
        self._full_of = full_of

    def __missing__(self, node: fx.Node) -> fx.Node:
        chain = [node]
        while True:
            top = chain[-1]
            if top.op == "placeholder" and info(top).role == PARAM_SHARD:
                root = self._full_of.get(info(top).unit, top)
                break
            source = _aliased_argument(top)
            if source is None:
                root = top
                break
            if source in self:
                root = dict.__getitem__(self, source)
                break
            chain.append(source)
        for n in chain:
            self[n] = root
        return root


class StorageRoots:
    """Storage roots and accesses of the nodes of ``gm``, each found when first asked for, so
    that a pass that asks about a few nodes pays for those (a node inserted since is found as
    well; one whose arguments changed since it was asked about keeps its first answer)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        full_of: dict[str | None, fx.Node] = {}
        for n in gm.graph.nodes:  # (placeholders lead the graph)
            if n.op != "placeholder":
                break
            if info(n).role == PARAM_FULL:
                full_of[info(n).unit] = n
        self.root: dict[fx.Node, fx.Node] = _Roots(full_of)
        self._access: dict[fx.Node, Access] = {}

    def access(self, node: fx.Node) -> Access:
        """What ``node`` itself reads and writes."""
        known = self._access.get(node)
        if known is None:
            reads = frozenset(self.root[a] for a in node.all_input_nodes)
            writes = {self.root[a] for a in written_arguments(node)}
            if self.root[node] is node and node.op != "output":
                writes.add(node)
            known = self._access[node] = Access(reads, frozenset(writes))
        return known

    def collective_access(self, start: fx.Node, wait: fx.Node) -> Access:
        """What a collective reads and writes while in flight (its start's inputs and output)."""
        started = self.access(start)
        return Access(started.reads, started.writes | {self.root[start]}) | self.access(wait)


def _schema_arguments(node: fx.Node) -> list[tuple[torch._C.Argument, object]]:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    schema = _arguments_of(target)
    pairs = list(zip(schema, node.args, strict=False))
    pairs += [(a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs]
    return pairs


@functools.cache
def _arguments_of(op: torch._ops.OpOverload) -> tuple[torch._C.Argument, ...]:
    """An op's schema arguments (torch builds the list anew on every read)."""
    return tuple(op._schema.arguments)


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    return []


# Batch norms that update their running statistics in training though their schemas declare no
# write (the functional-schema ``_native_batch_norm_legit`` declares it).
_UNDECLARED_WRITES = {
    aten.native_batch_norm.default,
    aten.cudnn_batch_norm.default,
    aten.miopen_batch_norm.default,
}


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node`` writes in place: those its schema marks ``!``, and the running
    statistics a training-mode batch norm updates though its schema does not say so."""
    pairs = _schema_arguments(node)
    written = [n for arg, value in pairs if arg.alias_info and arg.alias_info.is_write
               for n in _nodes_in(value)]  # fmt: skip
    if node.target in _UNDECLARED_WRITES:
        given = {arg.name: value for arg, value in pairs}
        if given.get("training"):
            written += [n for name in ("running_mean", "running_var")
                        for n in _nodes_in(given.get(name))]  # fmt: skip
    return written


def _returns_alias(node: fx.Node) -> bool:
    returns = getattr(getattr(node.target, "_schema", None), "returns", [])
    return len(returns) == 1 and returns[0].alias_info is not None


def _aliased_argument(node: fx.Node) -> fx.Node | None:
    """The argument whose storage the node's (single) result aliases, if any; for a getitem,
    the list of views (``split``'s result) it picks from."""
    target = node.target
    if node.op == "call_function" and target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and _returns_alias(source) else None
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if not _returns_alias(node):
        return None
    alias_set = target._schema.returns[0].alias_info.before_set
    for arg, value in _schema_arguments(node):
        alias = arg.alias_info
        # A list of views (``split(Tensor(a -> *) self) -> Tensor(a)[]``) names no set on the
        # list itself: its elements alias the argument that goes into the wildcard.
        if alias is not None and (
            alias.before_set == alias_set or (not alias_set and "*" in alias.after_set)
        ):
            return value if isinstance(value, fx.Node) else None
    return None


def last_writes(
    gm: fx.GraphModule, tensors: list[fx.Node], before: fx.Node
) -> dict[fx.Node, fx.Node]:
    """For each of ``tensors``, the last node before ``before`` that writes its storage (the
    tensor itself if none does), from one walk over the graph."""
    roots = StorageRoots(gm)
    last = {t: t for t in tensors}
    of_root: dict[object, list[fx.Node]] = {}
    for t in tensors:
        of_root.setdefault(roots.root[t], []).append(t)
    seen: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node is before:
            break
        seen.add(node)
        for root in roots.access(node).writes:
            for t in of_root.get(root, []):
                if t in seen and node is not t:
                    last[t] = node
    return last


def last_writes_before(
    gm: fx.GraphModule, pairs: list[tuple[fx.Node, fx.Node]]
) -> dict[fx.Node, fx.Node]:
    """For each ``(tensor, before)``, the last node between ``tensor`` and ``before`` that
    writes the tensor's storage (the tensor itself if none does), by tensor: what
    :func:`last_writes` gives each pair, from one walk over the graph."""
    roots = StorageRoots(gm)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    wanted = {roots.root[t] for t, _ in pairs}
    writers: dict[fx.Node, list[int]] = {root: [] for root in wanted}
    nodes = list(gm.graph.nodes)
    for i, node in enumerate(nodes):
        for root in roots.access(node).writes & wanted:
            writers[root].append(i)
    last = {}
    for tensor, before in pairs:
        at = writers[roots.root[tensor]]
        k = bisect.bisect_left(at, position[before]) - 1
        last[tensor] = nodes[at[k]] if k >= 0 and at[k] > position[tensor] else tensor
    return last
