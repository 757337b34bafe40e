"""A compute region's structural key: regions with one key run one compiled graph.

A repeated layer's copies (:mod:`zerocc.compiler.repeats`) are node for node the same ops on
inputs laid out alike; only the nodes' names and the tensors they read differ. So a region is
described by a *canonical* module: its placeholders named ``in_0, in_1, ...`` and its nodes
``v0, v1, ...`` in program order, its code printed (targets, literals, structure), and by its
inputs' layouts (shape, stride, dtype, device, storage offset and size, which inputs share a
storage) and its outputs' strides. Two regions with the same key are the same computation on
memory laid out the same way, so Inductor's code for one is correct for the other: it is
compiled once (:class:`~zerocc.backends.inductor.executable.InductorExecutable`), as
``torch.compile`` of a repeated module reuses its code through dynamo's cache. The canonical
module is also what Inductor is given, so its FX graph cache sees one graph per key, whatever
the layer or the model's depth: a second launch costs a lookup per distinct region.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import fx

from zerocc.ir.nodes import val


def _layout(value: Any, storages: dict[int, int]) -> Hashable:
    """What Inductor's code assumes of one input: its layout, and which storage (numbered by
    first appearance among the region's inputs) it lies in."""
    if not isinstance(value, torch.Tensor):
        return ("value", repr(value))
    storage = value.untyped_storage()
    index = storages.setdefault(storage._cdata, len(storages))
    return (
        tuple(value.shape),
        tuple(value.stride()),
        value.storage_offset(),
        value.dtype,
        str(value.device),
        index,
        storage.nbytes(),
    )


def canonical(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` (a region's) whose placeholders and nodes are named by position,
    their ``meta`` kept: the same graph for every copy of a layer."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = 0
    for node in module.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(f"in_{inputs}")
            env[node].meta = dict(node.meta)
            inputs += 1
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], env.__getitem__))
        else:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            name = f"v{len(env) - inputs}"
            env[node] = graph.create_node(node.op, node.target, args, kwargs, name=name)
            env[node].meta = dict(node.meta)
    graph.lint()
    return fx.GraphModule(module, graph)


def region_key(module: fx.GraphModule) -> tuple[Hashable, fx.GraphModule]:
    """The key of a region's ``module`` (made by
    :meth:`~zerocc.backends.inductor.regions.Region.graph_module`) and its canonical module.
    Equal keys: the same ops, the same literals, inputs laid out and aliased alike, outputs
    with the same strides."""
    named = canonical(module)
    code = named.graph.python_code("self").src
    storages: dict[int, int] = {}
    inputs = tuple(_layout(val(n), storages) for n in named.graph.nodes if n.op == "placeholder")
    (returned,) = (n.args[0] for n in named.graph.nodes if n.op == "output")
    strides = tuple(
        tuple(v.stride()) if isinstance(v := val(n), torch.Tensor) else None for n in returned
    )
    return (code, inputs, strides), named
