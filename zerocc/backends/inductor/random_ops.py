"""Random ops in the whole graph, drawn in the program's order: twins chained by a token.

A program that draws random numbers (dropout) draws them from the device's generator, and
recomputation replays a draw by saving the generator's state before it in forward and setting
it back around the draw's copy in backward (:mod:`zerocc.ir.rng`). Both rely on the order the
ops run in, which is nowhere in the data flow: Inductor, seeing one graph, may run a state read
after the draw it brackets, drop a ``set_rng_state`` (it returns nothing) or move a draw past
another. So :func:`thread_generator` turns every op that touches the generator into a twin of
the ``zerocc_lowered`` namespace that takes the previous one's *token* (an empty tensor) and
returns the next: the draws, the state reads and the state sets form one chain of data, which
Inductor keeps in order as it keeps any data dependency, and never fuses or drops (the twins
are side-effectful, opaque kernels).

- ``draw(tensors, call, after)`` runs the random op that ``call`` describes (a JSON record:
  the op's qualified name, its arguments with tensors as indices into ``tensors``) and returns
  its outputs and the token. An op that fills its first argument in place (``bernoulli_``, as
  dropout's decomposition draws) fills a new tensor instead, an empty one when the filled tensor
  came from an ``empty`` factory (the fill reads no value of it), a copy otherwise, and what
  read the filled tensor after the op reads the twin's output.
- ``rng_state(like, after)``, ``set_rng_state(state, like, after)`` and
  ``seed_draw(index, device, after)``: zerocc's generator-state ops with a token.

So a whole graph draws what the eager backend draws, replays included, bit for bit (ATen's
kernels draw; Inductor does not see them). The FX graph cache keeps such a graph as any other
(torch's own ordering of effectful ops, ``with_effects``, bypasses that cache). An op this form
cannot describe (an argument that is not a tensor, a number, a string, a dtype, a device, a
layout or a memory format, a result that is not tensors, or a fill of the program's input) is
named by :func:`unsupported`, and the program is compiled by region.
"""

from __future__ import annotations

import json
import operator
from typing import Any

import torch
from torch import fx
from torch.library import Library

from zerocc.ir.keyed_draws import SEED_DRAW
from zerocc.ir.nodes import op_name
from zerocc.ir.rng import RNG_STATE, SET_RNG_STATE, is_random

_lib = Library("zerocc_lowered", "FRAGMENT")
_lib.define("draw(Tensor[] tensors, str call, Tensor after) -> Tensor[]")
_lib.define("rng_state(Tensor like, Tensor after) -> (Tensor, Tensor)")
_lib.define("set_rng_state(Tensor state, Tensor like, Tensor after) -> Tensor")
_lib.define("seed_draw(int index, Device device, Tensor after) -> Tensor")

# Factories whose tensor holds no value an in-place fill could read.
_EMPTY = frozenset({"aten.empty_like", "aten.empty", "aten.empty_strided", "aten.new_empty"})
# Values of other types a call carries by name: dtypes, layouts, memory formats.
_NAMED = (torch.dtype, torch.layout, torch.memory_format)


class Undescribable(ValueError):
    """A random op :func:`describe` cannot put in a ``draw``."""


def _token() -> torch.Tensor:
    return torch.empty(0)


def _in_place(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` fills its first argument (and nothing else) and returns it."""
    written = [a for a in op._schema.arguments if a.alias_info and a.alias_info.is_write]
    return bool(written) and written == op._schema.arguments[:1]


def _encode(value: Any, tensors: list[fx.Node]) -> Any:
    if isinstance(value, fx.Node):
        if not isinstance(value.meta.get("val"), torch.Tensor):
            raise Undescribable(f"argument {value.name} is not a tensor")
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, _NAMED):
        return {"torch": str(value).removeprefix("torch.")}
    raise Undescribable(f"an argument of type {type(value).__name__}")


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "device" in value:
        return torch.device(value["device"])
    return getattr(torch, value["torch"])


def describe(node: fx.Node) -> tuple[str, list[fx.Node]]:
    """The ``call`` of a ``draw`` standing for random op ``node``, and the tensors it reads
    (raises :class:`Undescribable` naming what it cannot carry)."""
    op = node.target
    schema, in_place = op._schema, _in_place(op)
    if not in_place:
        if any(a.alias_info and a.alias_info.is_write for a in schema.arguments):
            raise Undescribable("writing an argument other than its first")
        results = [r.type for r in schema.returns]
        if not results or not all(isinstance(t, torch.TensorType) for t in results):
            raise Undescribable("a result that is not a tensor")
    tensors: list[fx.Node] = []
    filled = node.args[0] if in_place else None
    if isinstance(filled, fx.Node) and filled.op == "placeholder":
        # The twin fills a new tensor: the program's input would no longer change.
        raise Undescribable(f"filling the program's input {filled.name} in place")
    record = {
        "op": f"{op.namespace}::{schema.name.split('::')[-1]}.{op._overloadname}",
        "args": _encode(list(node.args), tensors),
        "kwargs": {k: _encode(v, tensors) for k, v in node.kwargs.items()},
        "fresh": filled is not None and op_name(filled.target) in _EMPTY,
    }
    return json.dumps(record), tensors


def _resolve(qualified: str) -> torch._ops.OpOverload:
    namespace, rest = qualified.split("::")
    name, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _draw(tensors: list[torch.Tensor], call: str, after: torch.Tensor) -> list[torch.Tensor]:
    record = json.loads(call)
    op = _resolve(record["op"])
    args = _decode(record["args"], tensors)
    kwargs = {k: _decode(v, tensors) for k, v in record["kwargs"].items()}
    if _in_place(op):
        # A new tensor filled, not the program's (a twin returns, never mutates).
        args[0] = torch.empty_like(args[0]) if record["fresh"] else args[0].clone()
        op(*args, **kwargs)
        return [args[0], _token()]
    out = op(*args, **kwargs)
    return [*(out if isinstance(out, tuple | list) else [out]), _token()]


def _rng_state(like: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return RNG_STATE(like), _token()


def _set_rng_state(state: torch.Tensor, like: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    SET_RNG_STATE(state, like)
    return _token()


def _seed_draw(index: int, device: torch.device, after: torch.Tensor) -> torch.Tensor:
    SEED_DRAW(index, device)
    return _token()


def _seed_draw_fake(index: int, device: torch.device, after: torch.Tensor) -> torch.Tensor:
    return _token()  # (the real one seeds the generator from the run's key: none at compile)


# The other fake implementations are the real ones: under fake tensors they draw nothing.
for _name, _impl, _fake in (
    ("draw", _draw, _draw),
    ("rng_state", _rng_state, _rng_state),
    ("set_rng_state", _set_rng_state, _set_rng_state),
    ("seed_draw", _seed_draw, _seed_draw_fake),
):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"zerocc_lowered::{_name}", lib=_lib)(_fake)
    torch.fx.node.has_side_effect(getattr(torch.ops.zerocc_lowered, _name).default)

DRAW = torch.ops.zerocc_lowered.draw.default
LOWERED_RNG_STATE = torch.ops.zerocc_lowered.rng_state.default
LOWERED_SET_RNG_STATE = torch.ops.zerocc_lowered.set_rng_state.default
LOWERED_SEED_DRAW = torch.ops.zerocc_lowered.seed_draw.default


def touches_generator(node: fx.Node) -> bool:
    """Whether ``node`` draws from, reads or sets a random number generator."""
    return is_random(node) or node.target in (RNG_STATE, SET_RNG_STATE, SEED_DRAW)


def unsupported(graph: fx.Graph) -> str | None:
    """Why a random op of ``graph`` cannot be drawn by a ``draw`` (None when all can)."""
    for node in graph.nodes:
        if is_random(node):
            try:
                describe(node)
            except Undescribable as exc:
                return f"it draws random numbers with {op_name(node.target)} ({exc})"
    return None


def thread_generator(graph: fx.Graph) -> None:
    """Rewrite, in place, every op of ``graph`` that touches the generator as its twin, each
    taking the token of the one before it in program order."""
    chain = [n for n in graph.nodes if touches_generator(n)]
    if not chain:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(chain[0]):
        after = graph.call_function(torch.ops.aten.empty.memory_format, ([0],))
    for node in chain:
        with graph.inserting_before(node):
            if node.target is RNG_STATE:
                twin = graph.call_function(LOWERED_RNG_STATE, (*node.args, after))
                outputs = [graph.call_function(operator.getitem, (twin, i)) for i in range(2)]
                node.replace_all_uses_with(outputs[0])
            elif node.target is SET_RNG_STATE:
                outputs = [graph.call_function(LOWERED_SET_RNG_STATE, (*node.args, after))]
            elif node.target is SEED_DRAW:
                outputs = [graph.call_function(LOWERED_SEED_DRAW, (*node.args, after))]
            else:
                outputs = _draw_node(graph, node, after, order)
        after = outputs[-1]
        graph.erase_node(node)


def _draw_node(
    graph: fx.Graph, node: fx.Node, after: fx.Node, order: dict[fx.Node, int]
) -> list[fx.Node]:
    """The ``draw`` standing for random op ``node`` (inserted before it), its uses moved to the
    draw's outputs; returns the outputs, the token last."""
    call, tensors = describe(node)
    twin = graph.call_function(DRAW, (tensors, call, after))
    if _in_place(node.target):
        count, filled = 1, node.args[0]
    else:
        count, filled = len(node.target._schema.returns), None
    outputs = [graph.call_function(operator.getitem, (twin, i)) for i in range(count + 1)]
    if filled is not None:
        # What reads the filled tensor after the fill reads the filled copy.
        later = [u for u in filled.users if order.get(u, -1) > order[node]]
        for user in later:
            user.replace_input_with(filled, outputs[0])
        node.replace_all_uses_with(outputs[0])
    elif count == 1:
        node.replace_all_uses_with(outputs[0])
    else:
        for user in list(node.users):  # getitem(node, i)
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    return outputs
