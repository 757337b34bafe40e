"""The facts passes derive about graph nodes, kept in ``node.meta["zerocc"]``.

The IR is an ordinary ``torch.fx.GraphModule``; this module holds the one typed record a node
carries (:class:`NodeInfo`) and the few helpers every pass uses to read and copy it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import fx

from zerocc.ir.kinds import OpKind, Role, Stream
from zerocc.ir.ops import COLLECTIVE_STARTS, TRANSFER_STARTS

Phase = Literal["forward", "backward", "optimizer"]

# The role names the passes use (members of Role).
PARAM_FULL, PARAM_SHARD, PARAM = Role.PARAM_FULL, Role.PARAM_SHARD, Role.PARAM
GRAD, OPTIM_STATE, BUFFER, BATCH = Role.GRAD, Role.OPTIM_STATE, Role.BUFFER, Role.BATCH
STEP, LR, MASTER, LOSS_SCALE = Role.STEP, Role.LR, Role.MASTER, Role.LOSS_SCALE
GATHERED, GRAD_SHARD, FOUND_INF = Role.GATHERED, Role.GRAD_SHARD, Role.FOUND_INF
# The roles of placeholders bound to persistent state (the state layout's specs).
STATE_ROLES = frozenset({PARAM_FULL, PARAM_SHARD, MASTER, GRAD, OPTIM_STATE, STEP, LR, LOSS_SCALE})
LOSS_SCALE_KEY = "amp.loss_scale"  # the loss scale's state key (there is one per step)


@dataclass
class NodeInfo:
    """What zerocc knows about one node. Every field is optional; passes fill what they derive."""

    phase: Phase | None = None  # forward, backward or optimizer
    module: str | None = None  # FQN of the source module ("" for the root)
    unit: str | None = None  # FSDP unit the node belongs to or acts on
    role: Role | None = None  # placeholder role or a computed role
    key: str | None = None  # state key the runtime binds a placeholder to
    stream: Stream = Stream.COMPUTE
    bytes: int = 0  # bytes a collective moves (per rank, logical size)
    no_grad: tuple[int, ...] = ()  # grad_shard: (offset, numel) pairs the loss does not reach
    # grad_shard of one parameter (world size 1: read where backward left it, not packed):
    # its (offset, numel) in the unit's flat buffer; None for a gradient of the whole flat
    span: tuple[int, int] | None = None
    note: str | None = None  # why the node is here, in words, for the printed program
    pool: str | None = None  # "host": the result lives in host memory, not on the device
    # Deferred updates (offload): the node applies the previous step's update (the update, its
    # inputs' host buffers, the copy of its result), which a program may run on its own.
    carried: bool = False


def info(node: fx.Node) -> NodeInfo:
    """The node's record, created empty on first access."""
    record = node.meta.get("zerocc")
    if record is None:
        record = node.meta["zerocc"] = NodeInfo()
    return record


def tag(node: fx.Node, **fields: Any) -> fx.Node:
    """Set fields of the node's record; returns the node for chaining."""
    record = info(node)
    for name, value in fields.items():
        setattr(record, name, value)
    return node


def copy_node(graph: fx.Graph, node: fx.Node, arg_map: Callable[[fx.Node], Any]) -> fx.Node:
    """``graph.node_copy`` that gives the copy its own record (fx only copies meta shallowly)."""
    new = graph.node_copy(node, arg_map)
    if "zerocc" in node.meta:
        new.meta["zerocc"] = dataclasses.replace(node.meta["zerocc"])
    return new


def placeholders(gm: fx.GraphModule, role: str | None = None) -> list[fx.Node]:
    """Placeholders of the graph, optionally only those of one role."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder" and (role is None or info(n).role == role)
    ]


def nodes_with_role(gm: fx.GraphModule, role: str) -> list[fx.Node]:
    """Computed (non-placeholder) nodes of one role, in program order."""
    return [n for n in gm.graph.nodes if n.op != "placeholder" and info(n).role == role]


def val(node: fx.Node) -> Any:
    """The fake value fx recorded for the node (a FakeTensor, a tuple, or None)."""
    return node.meta.get("val")


def is_alias_op(node: fx.Node) -> bool:
    """Whether the node returns a view of (an alias into) one of its inputs without writing it."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None


_ZEROCC_KINDS = {
    **dict.fromkeys(COLLECTIVE_STARTS, OpKind.COLLECTIVE),
    **dict.fromkeys(TRANSFER_STARTS, OpKind.TRANSFER),
    "wait": OpKind.WAIT,
    "host_wait": OpKind.WAIT,
    "free": OpKind.FREE,
    "host_buffer": OpKind.PLUMBING,  # an allocation (once per run), no work
    "rng_state": OpKind.RNG,
    "set_rng_state": OpKind.RNG,
    "seed_draw": OpKind.RNG,
}


def op_kind(node: fx.Node) -> OpKind:
    """What ``node`` does: the one classification every reader of a program shares."""
    if node.op != "call_function" or node.target is operator.getitem:
        return OpKind.PLUMBING
    name = op_name(node.target)
    kind = _ZEROCC_KINDS.get(name.removeprefix("zerocc.")) if name.startswith("zerocc.") else None
    if kind is not None:
        return kind
    if is_alias_op(node) and not any(
        a.alias_info is not None and a.alias_info.is_write for a in node.target._schema.arguments
    ):
        return OpKind.VIEW  # in-place ops (add_) alias their input too, but do work
    return OpKind.COMPUTE


def alias_closure(root: fx.Node) -> list[fx.Node]:
    """The node and every node that is (transitively) a view of it."""
    seen, stack = [root], [root]
    while stack:
        for user in stack.pop().users:
            if user not in seen and is_alias_op(user) and user.args and user.args[0] in seen:
                seen.append(user)
                stack.append(user)
    return seen


def op_name(target: Any) -> str:
    """Short readable name of a call target: ``aten.mm``, ``zerocc.all_gather_start``. A
    backend's function standing in for an op (``__wrapped__``) is named after the op.
    (Remembered per target: passes and reports ask ~700k times on the 405B example.)"""
    try:
        return _op_name(target)
    except TypeError:  # (an unhashable target)
        return _op_name.__wrapped__(target)


@functools.lru_cache(maxsize=4096)  # (bounded: a backend's targets come and go with programs)
def _op_name(target: Any) -> str:
    target = getattr(target, "__wrapped__", target)
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        name = target._schema.name.split("::")[-1]
        return f"{ns}.{name}"
    return getattr(target, "__name__", str(target))


def count_ops(nodes: Iterable[fx.Node]) -> dict[str, int]:
    """How many call_function nodes of each op name."""
    counts: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_function":
            name = op_name(n.target)
            counts[name] = counts.get(name, 0) + 1
    return counts


def emit(graph: fx.Graph, target: Any, args: tuple, **fields: Any) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, tagged with ``fields``; the node
    is named after the op (``all_gather_start``, ``wait_3``)."""
    name = op_name(target).rpartition(".")[2]
    return tag(graph.create_node("call_function", target, args, name=name), **fields)


def emit_collective(
    graph: fx.Graph,
    start: Any,
    wait: Any,
    args: tuple,
    *,
    nbytes: int,
    note: str,
    role: Role | None = None,
    **fields: Any,
) -> fx.Node:
    """Insert a collective as a start/wait pair on the comm stream; returns the wait."""
    started = emit(graph, start, args, stream=Stream.COMM, bytes=nbytes, note=note, **fields)
    return emit(graph, wait, (started,), stream=Stream.COMM, role=role, **fields)


def name_placeholder(node: fx.Node, text: str) -> fx.Node:
    """Name placeholder ``node`` after ``text`` (a state key, a parameter's FQN): the name is a
    Python identifier, unique in its graph, and also the node's target. Returns the node.

    fx's generated ``forward`` takes each placeholder as an argument named by its *target* and
    reads it by its *name*: a target that is no identifier (``0.param`` of an ``nn.Sequential``
    unit) is a syntax error, and two that read alike (``a-b``, ``a_b``) a duplicate argument.
    Characters other than ASCII letters, digits and ``_`` become ``_``, a leading digit gets a
    ``_`` before it; the graph's namespace then adds a ``_<n>`` suffix to a keyword, a builtin or
    a name already taken.
    """
    readable = re.sub(r"[^0-9a-zA-Z_]+", "_", text) or "_"
    if readable[0].isdigit():
        readable = f"_{readable}"
    if node.name != readable:
        node._rename(readable)  # through the namespace: unique, never a keyword or builtin
    node.target = node.name
    return node


class StateLike(Protocol):
    """What a state placeholder is made from (a :class:`zerocc.compiler.state.StateSpec`)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    unit: str | None


def state_placeholder(graph: fx.Graph, spec: StateLike, like: torch.Tensor) -> fx.Node:
    """A placeholder the runtime binds to persistent state ``spec``, with a fake value in
    ``like``'s fake mode and device. Inserted after the existing placeholders (which lead the
    graph: a program's inputs come first)."""
    anchor = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if anchor is None:
        node = graph.placeholder(spec.key)
    else:
        with graph.inserting_before(anchor):
            node = graph.placeholder(spec.key)
    name_placeholder(node, spec.key)  # fx made a name of the key, but left it the raw target
    with like.fake_mode:
        node.meta["val"] = torch.empty(spec.shape, dtype=spec.dtype, device=like.device)
    return tag(node, role=spec.role, key=spec.key, unit=spec.unit)


def comes_after(node: fx.Node, than: fx.Node) -> bool:
    """Whether ``node`` comes after ``than`` in their graph."""
    cursor = than.next
    while cursor.op != "root":
        if cursor is node:
            return True
        cursor = cursor.next
    return False
