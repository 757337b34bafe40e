"""A repeated layer's template (its forward and backward, traced on their own) and the copies
of it that stand for its calls in the step's graph (:mod:`zerocc.compiler.repeats`): the nodes,
their arguments and notes renamed for the call's layer, and fake values of their own that
share memory as the template's do."""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils._pytree import TreeSpec

from zerocc.compiler.module_marks import FORWARD_END, mark_node
from zerocc.ir.nodes import op_name
from zerocc.ir.ops import EXPERT_OP_NAMES

OUTPUT_GRADS = "output_grads"  # a template's mark where backward reaches its outputs' nodes
# Namespaces a template may not hold (nor expert parallelism's ops, whose keys are a call's)
_REFUSED_OPS = ("zerocc_opaque", "zerocc_repeat")


@dataclass(frozen=True)
class Layout:
    """A tensor as a template's key and fake values see it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass
class Template:
    """One traced call of a repeated module: its forward and backward nodes, and how the
    module's outputs and its inputs' gradients are found among them."""

    fqn: str  # the module it was traced on
    kind: str  # its class
    inputs: list[fx.Node]  # the call's tensors, then the module's parameters and buffers
    grad_inputs: list[fx.Node]  # a gradient of each output in ``differentiable``
    forward: list[fx.Node]
    backward: list[fx.Node]
    outputs: list[Any]  # the forward's output leaves: a node, or a constant (no tensor)
    output_spec: TreeSpec
    differentiable: list[int]  # positions (among tensor outputs) that take a gradient
    input_grads: list[fx.Node | None]  # each input's gradient (None: none reaches it)
    output_status: list[Hashable] = field(default_factory=list)  # each tensor output's
    # the scalar attributes its trace read, by (submodule, attribute): a call is a copy only
    # where its module holds the same values
    reads: dict[tuple[str, str], Any] = field(default_factory=dict)
    calls: int = 0

    @property
    def tensor_outputs(self) -> list[fx.Node]:
        return [o for o in self.outputs if isinstance(o, fx.Node)]


@dataclass
class Call:
    """One call of a template's module: where its copies read their inputs, and the memory
    their fake values share."""

    template: Template
    fqn: str
    env: dict[fx.Node, fx.Node] = field(default_factory=dict)  # template node -> its copy
    # a template value's storage -> a value of the copy's on the same memory, and the offset
    # of the copy's memory from the template's (non-zero for an argument that is a view)
    storages: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def bind(self, nodes: Sequence[fx.Node], args: Sequence[fx.Node]) -> None:
        """The template's inputs ``nodes`` are the call's ``args``."""
        for node, arg in zip(nodes, args, strict=True):
            self.env[node] = arg
            self._shares(node, arg)

    def seed(self, results: dict[fx.Node, fx.Node]) -> None:
        """The op's outputs (``results``: template node -> the op's output in the step's graph)
        hold the memory of the template nodes they stand for: what make_fx traced from them
        shares memory with them, so the copies do too."""
        for node, output in results.items():
            self._shares(node, output)

    def _shares(self, node: fx.Node, other: fx.Node) -> None:
        """The copies' values on the memory of ``node``'s value are on ``other``'s."""
        mine, theirs = node.meta["val"], other.meta["val"]
        delta = theirs.storage_offset() - mine.storage_offset()
        self.storages.setdefault(_storage(mine), (theirs, delta))


def template_of(
    graph: fx.Graph,
    fqn: str,
    kind: str,
    probe: list[Any],
    out_spec: TreeSpec,
    differentiable: list[int],
) -> Template | str:
    """The template in a traced joint graph, or why it cannot be one."""
    nodes = list(graph.nodes)
    inputs_all = [n for n in nodes if n.op == "placeholder"]
    n_tensor_out = sum(isinstance(o, torch.Tensor) for o in probe)
    n_inputs = len(inputs_all) - len(differentiable)
    inputs, grad_inputs = inputs_all[:n_inputs], inputs_all[n_inputs:]
    end = next(n for n in nodes if _is_mark(n, FORWARD_END))
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    if any(n.op != "call_function" for n in body):
        return "it holds a tensor constant or a submodule call"
    refused = [
        n
        for n in body
        if _namespace(n.target) in _REFUSED_OPS or op_name(n.target) in EXPERT_OP_NAMES
    ]
    if refused:
        return f"it holds {refused[0].target}"
    if _writes_inputs(body, inputs_all):
        return "its forward or backward writes into an input"
    position = {n: i for i, n in enumerate(nodes)}
    forward = [n for n in body if position[n] < position[end]]
    backward = [n for n in body if position[n] > position[end]]
    # The marks before the first OUTPUT_GRADS come from pre-hooks on the autograd nodes of the
    # module's outputs, where the step's graph has its own (of the module and of any ancestor
    # that returns the same tensor: the last of them names the ops that follow).
    first = next((i for i, n in enumerate(backward) if _is_mark(n, OUTPUT_GRADS)), None)
    if first is None:  # (no output takes a gradient: nothing ran backward)
        if any(n.target is not mark_node for n in backward):
            return "its backward began elsewhere than at its outputs"
        first = len(backward)
    backward = [n for n in backward[first:] if not _is_mark(n, OUTPUT_GRADS)]
    (returned,) = graph.output_node().args
    tensor_nodes = iter(returned[:n_tensor_out])
    outputs = [next(tensor_nodes) if isinstance(o, torch.Tensor) else o for o in probe]
    if any(not isinstance(o, fx.Node) for o in returned[:n_tensor_out]):
        return "an output is no traced tensor"
    input_grads = list(returned[n_tensor_out:])
    return Template(
        fqn,
        kind,
        inputs,
        grad_inputs,
        forward,
        backward,
        outputs,
        out_spec,
        differentiable,
        input_grads,
    )


def _is_mark(node: fx.Node, kind: str) -> bool:
    return node.target is mark_node and node.args[0] == kind


def _namespace(target: Any) -> str | None:
    return target.namespace if isinstance(target, torch._ops.OpOverload) else None


def _writes_inputs(body: list[fx.Node], inputs: list[fx.Node]) -> bool:
    """Whether an op writes into a tensor that shares memory with one of ``inputs``."""
    held = {_storage(n.meta["val"]) for n in inputs}
    for node in body:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        for arg, value in zip(target._schema.arguments, node.args, strict=False):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written and isinstance(value, fx.Node):
                val = value.meta.get("val")
                if isinstance(val, torch.Tensor) and _storage(val) in held:
                    return True
    return False


def copy_into(
    graph: fx.Graph,
    anchor: fx.Node,
    call: Call,
    nodes: list[fx.Node],
    results: list[fx.Node],
) -> list[fx.Node]:
    """Copy ``nodes`` (a template's) before ``anchor``, reading the call's nodes; the copies of
    ``results``."""
    env, old, new = call.env, call.template.fqn, call.fqn
    valued = []
    with graph.inserting_before(anchor):
        for node in nodes:
            copy = env[node] = graph.node_copy(node, env.__getitem__)
            if node.target is mark_node:
                kind, module = node.args
                copy.args = (kind, _renamed(module, old, new))
                continue
            if any(isinstance(a, str) and old in a for a in copy.args):
                copy.args = tuple(_renamed_in(a, old, new) for a in copy.args)
            if "custom" in copy.meta:  # (fx's annotations: a collective's note)
                copy.meta["custom"] = {
                    k: _renamed_in(v, old, new) for k, v in copy.meta["custom"].items()
                }
            if "val" in node.meta:
                valued.append((copy, node.meta["val"]))
    if valued:
        _give_values(valued, call)
    return [env[r] for r in results]


def _renamed_in(value: Any, old: str, new: str) -> Any:
    """``value`` with the module ``old`` named ``new`` wherever a text names it or its
    submodules (a note tensor parallelism's collectives carry, an argument)."""
    if not isinstance(value, str) or old not in value:
        return value
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, value)


def _renamed(module: str, old: str, new: str) -> str:
    if module == old or module.startswith(old + "."):
        return new + module[len(old) :]
    return module


def _give_values(valued: list[tuple[fx.Node, Any]], call: Call) -> None:
    """Give each copy a fake value like its template node's: the same metadata, sharing memory
    with the copies' values as the template's values share with each other's (and with the
    inputs': a view of an argument is a view of the call's argument). Made on the meta device
    and wrapped, not dispatched through the fake mode: ~5k values for a 7.5B GPT."""
    mode = next(_tensors(v for _, v in valued)).fake_mode
    with in_kernel_invocation_manager(mode):
        metas = [_value_like(v, call) for _, v in valued]
    for (copy, _), meta in zip(valued, metas, strict=True):
        copy.meta["val"] = _wrapped(meta, mode)


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)


def _value_like(value: Any, call: Call) -> Any:
    if isinstance(value, torch.Tensor):
        return (_tensor_like(value, call), value.fake_device)  # (.device says meta here)
    if isinstance(value, (tuple, list)):
        return type(value)(_value_like(v, call) for v in value)
    return value


def _wrapped(meta: Any, mode: Any) -> Any:
    if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[0], torch.Tensor):
        return FakeTensor(mode, meta[0], meta[1])
    if isinstance(meta, (tuple, list)):
        return type(meta)(_wrapped(m, mode) for m in meta)
    return meta


def _tensor_like(t: torch.Tensor, call: Call) -> torch.Tensor:
    """On the meta device (in the fake mode's kernel invocation), a tensor like ``t``."""
    key = _storage(t)
    if key not in call.storages:  # memory the template's forward or backward allocates
        whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == extent(t)
        if whole:
            fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        else:
            n = t.untyped_storage().nbytes() // t.element_size()
            fresh = torch.empty(n, dtype=t.dtype, device="meta")
        call.storages[key] = (fresh, 0)
        if whole:
            return fresh
    owner, delta = call.storages[key]
    if owner.dtype != t.dtype:
        delta = delta * owner.element_size() // t.element_size()  # (in t's elements)
        n = owner.untyped_storage().nbytes() // owner.element_size()
        owner = owner.as_strided((n,), (1,), 0).view(t.dtype)
    return owner.as_strided(t.shape, t.stride(), t.storage_offset() + delta)


def _storage(t: torch.Tensor) -> int:
    """Which memory ``t`` is on (the templates' values, which hold it, outlive the capture)."""
    return t.untyped_storage()._cdata


def extent(t: torch.Tensor) -> int:
    """Bytes from the start of ``t``'s storage to the end of its last element."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()
