"""Where the captured graph uses each FSDP unit: the analysis the shard pass acts on.

Nodes computed from parameters alone (``t(W)``, ``expand(b)``, a cast of a weight) are
*param-derived*: they cost nothing to recompute, so the shard pass re-derives them next to each
consumer from whichever gathered copy of the unit is live there, instead of keeping a forward
view of a parameter alive into backward. Every other node is *compute*; a unit's use window in
a phase runs from its first to its last compute consumer in that phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from zerocc.ir.nodes import PARAM, info
from zerocc.ir.rng import is_random


@dataclass
class ParamUses:
    """The shard pass's view of the captured graph."""

    unit_of: dict[fx.Node, str]  # parameter placeholder -> unit name
    derived: set[fx.Node]  # nodes computed from parameters only
    roots: dict[fx.Node, frozenset[str]]  # param or derived node -> units it reads
    windows: dict[tuple[str, str], tuple[fx.Node, fx.Node]]  # (unit, phase) -> first, last use
    grads: dict[str, fx.Node | None]  # trainable parameter FQN -> its gradient node
    order: dict[fx.Node, int] = field(default_factory=dict)  # node -> position in the program
    _window_edges: tuple[dict, dict] | None = field(default=None, repr=False)

    def units_used_by(self, node: fx.Node) -> set[str]:
        used: set[str] = set()
        for arg in node.all_input_nodes:
            used |= self.roots.get(arg, frozenset())
        return used

    def starting_at(self, node: fx.Node) -> list[str]:
        """The units whose use window (in some phase) opens at ``node``."""
        return self._edges()[0].get(node, [])

    def ending_at(self, node: fx.Node) -> list[str]:
        """The units whose use window (in some phase) closes at ``node``."""
        return self._edges()[1].get(node, [])

    def _edges(self) -> tuple[dict[fx.Node, list[str]], dict[fx.Node, list[str]]]:
        """Each window's first and last node, to the units whose windows they are (in the
        windows' order), found once: the shard pass asks at every node."""
        if self._window_edges is None:
            starts: dict[fx.Node, list[str]] = {}
            ends: dict[fx.Node, list[str]] = {}
            for (unit, _), (first, last) in self.windows.items():
                starts.setdefault(first, []).append(unit)
                ends.setdefault(last, []).append(unit)
            self._window_edges = starts, ends
        return self._window_edges


def _mutates(node: fx.Node) -> bool:
    """Writes an input, or draws random numbers: never re-derived (a second draw differs)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        target._schema.is_mutable or is_random(node)
    )


def analyze(gm: fx.GraphModule, trainable_fqns: list[str]) -> ParamUses:
    """Find param-derived nodes, each unit's use windows per phase, and the gradient nodes."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    returned = set(output.all_input_nodes)
    unit_of = {n: info(n).unit for n in nodes if n.op == "placeholder" and info(n).role == PARAM}
    roots: dict[fx.Node, frozenset[str]] = {n: frozenset({u}) for n, u in unit_of.items()}
    derived: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function" or n in returned or _mutates(n):
            continue
        inputs = n.all_input_nodes
        if inputs and all(a in roots for a in inputs):
            derived.add(n)
            roots[n] = frozenset().union(*(roots[a] for a in inputs))
    windows: dict[tuple[str, str], tuple[fx.Node, fx.Node]] = {}
    uses = ParamUses(unit_of, derived, roots, windows, {})
    for n in nodes:
        if n.op != "call_function" or n in derived:
            continue
        for unit in uses.units_used_by(n):
            key = (unit, info(n).phase)
            windows[key] = (windows.get(key, (n, n))[0], n)
    grad_nodes = output.args[0][1:]  # none in a forward-only (evaluation) program
    uses.grads = dict(zip(trainable_fqns, grad_nodes, strict=True)) if grad_nodes else {}
    uses.order = {n: i for i, n in enumerate(nodes)}
    return uses
