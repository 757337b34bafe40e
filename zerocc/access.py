"""Which storages each node of a program reads and writes: what a scheduling pass may not
reorder.

Every tensor value belongs to one *storage root*: the node that allocated it, or the placeholder
the runtime binds. Views, in-place ops and ``wait`` return an alias of an argument (their schemas
say which), so they share that argument's root. Stages 1-2 bind a unit's ``param_shard``
placeholder to a view of its ``param_full``: both are one root. A node *reads* the roots of its
tensor inputs and *writes* the roots of the arguments its schema marks mutable; a node that
allocates also writes its own root (it defines it).

A collective is in flight from its start to its wait: during that span it reads its inputs and
writes its output, so :func:`collective_access` charges both to the pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from zerocc.ir import PARAM_FULL, PARAM_SHARD, info


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


class StorageRoots:
    """Storage roots and accesses of every node of ``gm`` (computed once, on construction)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        full_of = {
            info(n).unit: n
            for n in gm.graph.nodes
            if n.op == "placeholder" and info(n).role == PARAM_FULL
        }
        self.root: dict[fx.Node, fx.Node] = {}
        self._access: dict[fx.Node, Access] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder" and info(node).role == PARAM_SHARD:
                self.root[node] = full_of.get(info(node).unit, node)
            else:
                source = _aliased_argument(node)
                self.root[node] = self.root[source] if source is not None else node

    def access(self, node: fx.Node) -> Access:
        """What ``node`` itself reads and writes."""
        known = self._access.get(node)
        if known is None:
            reads = frozenset(self.root[a] for a in node.all_input_nodes)
            writes = {self.root[a] for a in _written_arguments(node)}
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
    schema = target._schema.arguments
    pairs = list(zip(schema, node.args, strict=False))
    pairs += [(a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs]
    return pairs


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    return []


def _written_arguments(node: fx.Node) -> list[fx.Node]:
    return [
        n
        for arg, value in _schema_arguments(node)
        if arg.alias_info is not None and arg.alias_info.is_write
        for n in _nodes_in(value)
    ]


def _aliased_argument(node: fx.Node) -> fx.Node | None:
    """The argument whose storage the node's (single) result aliases, if any."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    returns = target._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None:
        return None
    alias_set = returns[0].alias_info.before_set
    for arg, value in _schema_arguments(node):
        if arg.alias_info is not None and arg.alias_info.before_set == alias_set:
            return value if isinstance(value, fx.Node) else None
    return None
