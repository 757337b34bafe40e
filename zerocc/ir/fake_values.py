"""Fake values of a program's nodes (``meta["val"]``), kept current as passes rewrite it.

A pass adds nodes without values, rewires existing ones, or retypes a placeholder; everything
downstream of such a change needs its value again, and nothing else does. Each node records
what its value was computed from: its target, the versions of its inputs' values and its
literal arguments. :func:`propagate_fake_values` runs on fake tensors exactly the nodes with no
value or whose record no longer matches, in program order, so a value that changes makes its
users run again. Re-running every node after every pass was ~70% of compile time on a 7B model.
A node whose operands were replaced by values of the same layout need not run either when its
op makes a new tensor from their layout alone (a matmul of a gathered weight that replaced the
parameter): its value would come out as it is. A view runs its meta kernel without the fake
mode's dispatch (:func:`_run`).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.node import map_aggregate, map_arg

from zerocc.ir.nodes import info

_VERSION = "zerocc_val_version"  # (the value it versions, its version)
_SOURCE = "zerocc_val_source"  # what the node's value was computed from
_OPERANDS = "zerocc_val_operands"  # its arguments, each operand as the layout of its value
_LITERALS = "zerocc_val_literals"  # (args, kwargs, their text): see _literals
_versions = itertools.count()


def propagate_fake_values(gm: fx.GraphModule) -> int:
    """Give every ``call_function`` node of ``gm`` a fake value computed from its current
    inputs, running only those whose value is missing or stale; returns how many ran. A node
    that has a value and no record yet (just captured, or made by a pass with its value) is
    taken as current."""
    mode = _fake_mode(gm)
    ran = 0
    owned: set[int] = set()  # the value tensors seen so far: a node's value is its own
    with mode:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            source = _source(node)
            # A node copied with its meta (recompute's forward copies) holds its original's
            # value object: it needs one of its own, in storage of its own.
            copied = _claim(node.meta.get("val"), owned, node)
            if not copied and "val" in node.meta:
                if node.meta.setdefault(_SOURCE, source) == source:
                    if _OPERANDS not in node.meta:
                        node.meta[_OPERANDS] = _operands(node)
                    continue
                if _same_operands(node):  # its value would come out as it is: keep it
                    node.meta[_SOURCE] = source
                    continue
            value = _run(node)
            if copied or not _same_fresh_value(node.meta.get("val"), value, node):
                node.meta["val"] = value
                _claim(value, owned)
            node.meta[_SOURCE] = source
            node.meta[_OPERANDS] = _operands(node)
            ran += 1
    return ran


@functools.cache
def _view(target: Any) -> bool:
    """Whether ``target`` is an ATen op that returns one view of its first operand and reads
    no other tensor (``t``, ``view``, ``transpose``, ``slice``, ``expand``, ...)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    schema = target._schema
    returns, arguments = schema.returns, schema.arguments
    return (
        len(returns) == 1
        and str(returns[0].type) == "Tensor"
        and returns[0].alias_info is not None
        and not returns[0].alias_info.is_write
        and bool(arguments)
        and arguments[0].alias_info is not None
        and not arguments[0].alias_info.is_write
        and all("Tensor" not in str(a.type) for a in arguments[1:])
    )


@functools.cache
def _fresh(target: Any) -> bool:
    """Whether ``target`` is an ATen op whose result is a new tensor whose shape, strides and
    dtype follow from those of its operands and its literal arguments alone: it neither views
    nor writes an operand, and no value decides its shape."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    schema = target._schema
    data_dependent = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
    return (
        all(r.alias_info is None for r in schema.returns)
        and all(a.alias_info is None for a in schema.arguments)
        and not data_dependent.intersection(target.tags)
    )


def _operands(node: fx.Node) -> Any:
    """The node's arguments with the layout of its operands' current values in place of the
    operands (None for an op :func:`_fresh` does not cover: nothing to compare)."""
    if not _fresh(node.target):
        return None
    return map_aggregate(map_arg((node.args, node.kwargs), lambda n: n.meta.get("val")), _layout)


def _same_operands(node: fx.Node) -> bool:
    """Whether ``node``'s operands now are what its value was computed from, up to their
    identity: a fresh op (:func:`_fresh`) with the same literal arguments, on operands of the
    same shapes, strides, dtypes and devices (where an operand starts in its storage does not
    matter to a new tensor), computes a value of the same metadata, which
    :func:`_same_fresh_value` would keep. On a GPT this spares a quarter of the runs that
    sharding and the precision casts cause: matmuls, casts and norms of replaced operands."""
    before = node.meta.get(_OPERANDS)
    return before is not None and before == _operands(node)


def _layout(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return ("tensor", value.shape, value.stride(), value.dtype, value.device, value.layout)


def _claim(value: Any, owned: set[int], node: fx.Node | None = None) -> bool:
    """Record ``value``'s tensors as ``node``'s own; whether another node held one already. An
    op that returns its operand itself (``wait``, ``all_reduce_start``: their schemas alias
    it) holds its operand's value as its own: not a copy, nothing to run again."""
    ids = [id(t) for t in _tensors(value)]
    taken = [i for i in ids if i in owned]
    owned.update(ids)
    if not taken or node is None:
        return bool(taken)
    passed = {id(t) for n in node.all_input_nodes for t in _tensors(n.meta.get("val"))}
    return any(i not in passed for i in taken)


def propagate_all_fake_values(gm: fx.GraphModule) -> None:
    """Recompute ``meta["val"]`` of every node from the placeholders' fake values (what
    :func:`propagate_fake_values` must agree with; the tests hold one to the other)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, _fake_mode(gm)).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        node.meta.pop(_SOURCE, None)


def fake_constants(gm: fx.GraphModule) -> list[tuple[list[str], tuple[int, ...]]]:
    """The constants of ``gm`` (``get_attr`` nodes) that are fake tensors, each as the modules
    of the nodes that read it and its shape: tensors a trace kept that it did not compute
    (made on fake tensors elsewhere, by another trace of the model), with no value to run on."""
    found = []
    for node in gm.graph.nodes:
        value: Any = gm
        for name in str(node.target).split(".") if node.op == "get_attr" else ():
            value = getattr(value, name, None)
        if node.op == "get_attr" and isinstance(value, FakeTensor):
            readers = sorted({info(u).module or "" for u in node.users})
            found.append((readers, tuple(value.shape)))
    return found


def example_value(graph: fx.Graph) -> torch.Tensor:
    """The first fake tensor the graph holds: an input's (placeholders come first), or, in a
    pipeline stage's program that reads nothing but what it receives, a computed one's."""
    values = (n.meta.get("val") for n in graph.nodes)
    return next(v for v in values if isinstance(v, torch.Tensor))


def _fake_mode(gm: fx.GraphModule) -> Any:
    return example_value(gm.graph).fake_mode


def _version(node: fx.Node) -> int:
    """A number that changes whenever ``node``'s value is replaced (by propagation or by a
    pass that sets it, as a placeholder's retyping does)."""
    value = node.meta.get("val")
    tagged = node.meta.get(_VERSION)
    if tagged is None or tagged[0] is not value:
        tagged = node.meta[_VERSION] = (value, next(_versions))
    return tagged[1]


def _source(node: fx.Node) -> tuple:
    inputs = tuple(_version(n) for n in node.all_input_nodes)
    return (node.target, inputs, _literals(node))


def _literals(node: fx.Node) -> str:
    """``node``'s arguments as text, its operands by name; remembered while its arguments are
    the same objects (fx gives a node new ones whenever an argument changes)."""
    args, kwargs = node.args, node.kwargs
    known = node.meta.get(_LITERALS)
    if known is None or known[0] is not args or known[1] is not kwargs:
        known = (args, kwargs, repr(map_arg((args, kwargs), lambda n: n.name)))
        node.meta[_LITERALS] = known
    return known[2]


def _same_fresh_value(old: Any, new: Any, node: fx.Node) -> bool:
    """Whether ``new`` may be dropped for ``old``: the same shapes, strides, dtypes and
    devices, in storage of its own (no view or in-place result of an input, whose storage must
    be the input's for the liveness analysis). Keeping ``old`` keeps its version, so the
    node's users need not run again: a change stops spreading where values stop changing."""
    olds, news = _tensors(old), _tensors(new)
    if old is None or len(olds) != len(news) or type(old) is not type(new):
        return False
    inputs = {
        t.untyped_storage()._cdata
        for n in node.all_input_nodes
        for t in _tensors(n.meta.get("val"))
    }
    return all(
        (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
        and b.untyped_storage()._cdata not in inputs
        for a, b in zip(olds, news, strict=True)
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # (most values: no walk)
        return [value]
    found: list[torch.Tensor] = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _run(node: fx.Node) -> Any:
    """``node`` run on its inputs' fake values. Without autograd: a value records no graph,
    so it needs no detached copy (making one was a sixth of propagation's time). A view
    (:func:`_view`) runs its meta kernel on the operand as the fake mode's own dispatch would,
    without the dispatch: the shard pass's slices and views of gathered buffers (~10k on the
    70B tp example) cost a fraction of a fake dispatch each."""
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with torch.no_grad():
        if _view(node.target) and isinstance(args[0], FakeTensor):
            base = args[0]
            with in_kernel_invocation_manager(base.fake_mode):
                meta = node.target(*args, **kwargs)
            return FakeTensor(base.fake_mode, meta, base.fake_device)
        return node.target(*args, **kwargs)
