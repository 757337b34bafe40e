"""Splitting a bound program into compute regions: the runs of ops between zerocc's own.

A region is a maximal run of consecutive compute nodes (ATen ops, with the getitems of their
tuple results, wherever the program reads them) that holds no zerocc op: collectives, waits,
copies, frees, the optimizer update and the RNG replay ops stay in the top graph, in the order
the passes scheduled them, and each region becomes one ``call_module`` node in their place.
Random ops (dropout's) stay there too, run by ATen: their draws are the eager backend's on every
torch release (Inductor's ``fallback_random`` alone kept them so on torch 2.13, not on 2.11,
which decomposes dropout into draws of another op); so do the ops Inductor lowers wrongly
(:mod:`zerocc.backends.inductor.unlowerable`). A region reads values from before it and
returns those read after it (or by the program's output). Runs too small to gain from compiling
(views alone, or fewer compute ops than ``min_ops``) stay inline.

A run is also cut where the layer its nodes come from changes (:func:`layer_of`: the numbered
child of a ``ModuleList`` or ``Sequential`` a node's module lies in, as repeated layers are),
so that each layer's compute is regions of its own, the same in every copy of the layer: the
executable compiles each distinct one once (:mod:`zerocc.backends.inductor.region_keys`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from zerocc.backends.inductor.unlowerable import unlowerable
from zerocc.ir.kinds import OpKind
from zerocc.ir.nodes import info, op_kind, tag
from zerocc.ir.rng import is_random

REGION_PREFIX = "region_"


@dataclass
class Region:
    """One run of compute nodes, in program order, with what it reads and returns."""

    name: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]

    def graph_module(self, root: fx.GraphModule) -> fx.GraphModule:
        """The region as a module of its own: its inputs as placeholders, its outputs as a
        tuple, nodes copied with their ``meta``."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in self.inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for node in self.nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[n] for n in self.outputs))
        return fx.GraphModule(root, graph)


def _compute(node: fx.Node) -> bool:
    """A node a region may hold: an ATen op that is neither zerocc's, nor plumbing, nor
    random, nor one Inductor lowers wrongly."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if is_random(node) or unlowerable(node):
        return False
    return node.target.namespace == "aten" and op_kind(node) is not OpKind.PLUMBING


def _counts(node: fx.Node) -> bool:
    """A node whose compilation can gain something (a view costs nothing either way)."""
    return op_kind(node) not in (OpKind.VIEW, OpKind.PLUMBING)


def layer_of(node: fx.Node) -> str | None:
    """The layer ``node`` comes from: the shortest prefix of its module's name that ends in an
    index (``transformer.h.3`` of ``transformer.h.3.attn.c_proj``); ``""`` outside every
    layer; None where the node names no module (views of a flat parameter, casts the passes
    added)."""
    module = info(node).module
    if module is None:
        return None
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def layers(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Each node's layer (:func:`layer_of`); a node that names no module takes the layer of its
    first reader that has one (a view of the next unit's flat parameter, made before that
    unit's compute, belongs with it, not with the layer before), else None: it joins whatever
    layer its run is in."""
    found: dict[fx.Node, str | None] = {}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in reversed(gm.graph.nodes):
        layer = layer_of(node)
        if layer is None:
            readers = sorted(node.users, key=position.__getitem__)
            layer = next((found[u] for u in readers if found.get(u) is not None), None)
        found[node] = layer
    return found


def find_regions(gm: fx.GraphModule, min_ops: int = 2) -> list[Region]:
    """The program's compute regions worth compiling, in program order, each within one
    layer (or outside every layer)."""
    runs: list[list[fx.Node]] = [[]]
    pulled: set[fx.Node] = set()
    layer: str | None = None  # the layer of the run being gathered
    layer_by_node = layers(gm)
    for node in gm.graph.nodes:
        if node in pulled:
            continue
        if _compute(node):
            here = layer_by_node[node]
            if here is not None and layer is not None and here != layer and runs[-1]:
                runs.append([])
            if here is not None:
                layer = here
            runs[-1].append(node)
            # A multi-output op's getitems go with it, even those the program reads later
            # (after a collective): a region returns tensors, never a tuple with holes.
            items = [u for u in node.users if u.target is operator.getitem]
            runs[-1] += items
            pulled.update(items)
        elif runs[-1]:
            runs.append([])
            layer = None
    regions = []
    for run in runs:
        if sum(map(_counts, run)) < min_ops:
            continue
        inside = set(run)
        inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in run if any(u not in inside for u in n.users)]
        regions.append(Region(f"{REGION_PREFIX}{len(regions)}", run, inputs, outputs))
    return regions


def outline(gm: fx.GraphModule, regions: list[Region], modules: list[nn.Module]) -> fx.GraphModule:
    """``gm`` with each region replaced by a ``call_module`` of its module (``modules``, one
    per region, made before ``gm`` changes; each a submodule of the result under the region's
    name) and ``getitem`` nodes for what it returns. The call node carries the tags of the
    region's first node (its phase, unit)."""
    replaced: dict[fx.Node, fx.Node] = {}  # a region's output -> the getitem standing for it
    for region, module in zip(regions, modules, strict=True):
        gm.add_submodule(region.name, module)
        first = region.nodes[0]
        with gm.graph.inserting_before(first):
            args = tuple(replaced.get(n, n) for n in region.inputs)
            call = gm.graph.call_module(region.name, args)
            tag(call, phase=info(first).phase, unit=info(first).unit)
            for index, node in enumerate(region.outputs):
                item = gm.graph.call_function(operator.getitem, (call, index))
                item.meta = dict(node.meta)
                node.replace_all_uses_with(item)
                replaced[node] = item
        for node in reversed(region.nodes):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
