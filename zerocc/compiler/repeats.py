"""Repeated layers: a layer whose twins run alike is traced once; its other calls are copies.

A transformer's blocks are one class called N times on tensors of one shape: tracing each call
through make_fx costs N times the tracing of one block, most of a capture's time. Here the
first call of such a layer, for each kind of call, is traced on its own as a *template*: the
module's forward on fresh inputs, then its backward by ``torch.autograd.grad`` from fresh
gradients of its outputs, one graph with a mark between the two. Every call, the first
included, enters the step's graph as one op, ``zerocc_repeat.layer``, whose autograd is one
``zerocc_repeat.layer_backward``; once make_fx is done, :meth:`RepeatedLayers.expand` replaces
each by a copy of the template's forward or backward nodes, reading the call's own arguments,
with fake values of their own that share memory as the template's do. The graph the passes
read is the one make_fx traces call by call: the same ops on the same arguments, in the same
order, tagged alike (tests/compiler/test_repeats.py compares the two). One difference: where a
layer's input also reaches the loss another way (a layer called twice, a residual read around
it), autograd adds that input's gradients as they arrive, and a copy's arrive together, when
its backward ends: the same terms, summed in another order.

**Which calls are copies.** A candidate is a layer (a child of an ``nn.ModuleList`` or
``nn.Sequential``) that holds parameters, has the fingerprint of another candidate
(:func:`fingerprint`: its submodules' classes and attributes, its parameters' and buffers'
names, shapes and dtypes), shares no submodule with the rest of the model, has no hooks but
ones that say they run alike for each twin, and lies in no other candidate. A call is a copy of
a template when the module's fingerprint, the call's structure and non-tensor arguments, and
each tensor's shape, strides, dtype, device and ``requires_grad`` are the template's. A
template is refused, and its calls traced one by one, when tracing it changed the module's
attributes, it writes into an input, it holds an opaque region or a tensor constant, or an
argument is a view at an offset or no plain value: :meth:`RepeatedLayers.summary` says which
and why (``zerocc inspect`` prints it under capture). Tensor parallelism's split forwards and
sequence gathers, put in place per layer, say what makes them differ from their twins'
(:class:`RepeatKeyed`), and what sequence parallelism knows of each tensor is carried through
templates and copies (:class:`TensorStatus`). A Hugging Face decoder layer holds its
``layer_idx``, so its twins differ: they are traced one by one. What a fingerprint cannot see
is state outside the module (a global the forward reads and changes): a model whose layers
differ that way is compiled with ``capture.repeated_layers: false``.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import re
import types
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from zerocc.compat import MAKE_FX_OPTIONS
from zerocc.compiler.module_marks import FORWARD_END, ModuleTracker, mark_node
from zerocc.errors import CaptureError

# nn.Module's own attributes (parameters, submodules, hooks, mode), and transformers' flag of
# a module whose weights it initialized (set on some of a model's modules, never read by a
# forward): a fingerprint reads the rest.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"_is_hf_initialized"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device, enum.Enum, type)


class RepeatKeyed(Protocol):
    """An object a layer holds (a forward or a hook put in place per layer) that says what
    makes it differ from its twins' (the same for all of them when it runs alike for each,
    its layer's name apart): tensor parallelism's split forwards and sequence gathers."""

    def repeat_key(self) -> Hashable: ...


class TensorStatus(Protocol):
    """What a capture mode knows of each tensor beyond its metadata (sequence parallelism:
    whether it is a chunk of the sequence), which a template's inputs and a copy's outputs
    must be given as the call's and the template's had."""

    def status_of(self, t: torch.Tensor) -> Hashable: ...

    def set_status(self, t: torch.Tensor, status: Hashable) -> None: ...


def _value_key(value: Any) -> Any:
    """What a fingerprint holds of an attribute's value: the value itself for plain data, its
    repeat key for a :class:`RepeatKeyed`, the object's identity otherwise (two instances
    holding the same config object match; two holding equal but distinct tensors do not)."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if callable(getattr(value, "repeat_key", None)):  # (see RepeatKeyed)
        return ("keyed", value.repeat_key())
    if isinstance(value, (tuple, list, frozenset)):
        return (type(value), tuple(_value_key(v) for v in value))
    return ("object", id(value))


def fingerprint(module: nn.Module, scalars: bool = False) -> tuple:
    """What decides the graph ``module``'s forward traces to, but for its call and for its
    scalar attributes (numbers and strings: a Hugging Face layer's ``layer_idx``), whose
    names and types it holds, not their values (a template says which of them its trace read,
    :func:`_reads_recorded`): every submodule's name, class, mode and other attributes (by
    value for plain data, by identity for objects), and every parameter's and buffer's name,
    shape, dtype and ``requires_grad``, with which of them are the same tensor. (The module's
    own ``forward`` attribute, the one capture puts in place of its class's, is no part of
    it.) ``scalars``: their values too."""
    modules = tuple(
        (name, type(m), m.training, _attributes(m, own=not name, scalars=scalars))
        for name, m in module.named_modules(remove_duplicate=False)
    )
    first: dict[int, int] = {}
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad, first.setdefault(id(t), i))
        for i, (name, t) in enumerate(
            itertools.chain(
                module.named_parameters(remove_duplicate=False),
                module.named_buffers(remove_duplicate=False),
            )
        )
    )
    return modules, tensors


def _attributes(module: nn.Module, own: bool, scalars: bool) -> tuple:
    skip = _MODULE_INTERNALS | {"forward"} if own else _MODULE_INTERNALS
    return tuple(
        (k, ("scalar", type(v)) if _is_scalar(v) and not scalars else _value_key(v))
        for k, v in sorted(vars(module).items())
        if k not in skip
    )


def _is_scalar(value: Any) -> bool:
    return type(value) in (int, float, str)


def _scalars(module: nn.Module) -> dict[str, set[str]]:
    """The scalar attributes of each submodule of ``module`` (by its name in ``module``)."""
    found = {}
    for name, m in module.named_modules(remove_duplicate=False):
        names = {k for k, v in vars(m).items() if k not in _MODULE_INTERNALS and _is_scalar(v)}
        if names:
            found[name] = names
    return found


@contextlib.contextmanager
def _reads_recorded(module: nn.Module) -> Iterator[dict[tuple[str, str], Any]]:
    """In the body, every read of a scalar attribute of ``module`` or a submodule is recorded
    (``(submodule, attribute) -> value``): each is made an instance of a subclass of its class
    whose ``__getattribute__`` notes them. A trace that read none of them is the trace of a
    twin whose scalars differ."""
    reads: dict[tuple[str, str], Any] = {}
    swapped = []
    for name, names in _scalars(module).items():
        m = module.get_submodule(name)
        cls = type(m)
        m.__class__ = type(cls.__name__, (cls,), {"__getattribute__": _noting(name, names, reads)})
        swapped.append((m, cls))
    try:
        yield reads
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def _noting(module: str, names: set[str], reads: dict[tuple[str, str], Any]):
    def __getattribute__(self: nn.Module, name: str) -> Any:
        value = object.__getattribute__(self, name)  # (AttributeError: nn.Module's __getattr__)
        if name in names:
            reads[(module, name)] = value
        return value

    return __getattribute__


def _reads_match(module: nn.Module, reads: dict[tuple[str, str], Any]) -> bool:
    """Whether ``module`` holds the values a template's trace read."""
    return all(
        getattr(module.get_submodule(name), attribute) == value
        for (name, attribute), value in reads.items()
    )


def _hooks_print(module: nn.Module) -> tuple | None:
    """The module's hooks by their repeat keys, or None when one has none (a hook a template
    cannot copy: what it does for one layer, it would do for all)."""
    keys = tuple(_value_key(h) for name in _HOOKS for h in getattr(module, name, {}).values())
    return None if any(k[0] == "object" for k in keys) else keys


def candidates(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` (by FQN) whose calls may be copies of a template (see the
    module's docstring); none when global module hooks are registered."""
    if any(getattr(nn.modules.module, h, None) for h in _GLOBAL_HOOKS):
        return {}
    named = list(model.named_modules(remove_duplicate=False))
    uses = Counter(id(m) for _, m in named)
    layers = {
        f"{fqn}.{name}" if fqn else name
        for fqn, m in named
        if isinstance(m, (nn.ModuleList, nn.Sequential))
        for name in m._modules
    }
    eligible: dict[str, nn.Module] = {}
    prints: dict[str, tuple] = {}
    for fqn, m in named:
        if fqn not in layers or "forward" in vars(m) or next(m.parameters(), None) is None:
            continue
        subtree = list(m.modules())
        hooks = [_hooks_print(s) for s in subtree]
        if any(uses[id(s)] > 1 for s in subtree) or None in hooks:
            continue
        eligible[fqn], prints[fqn] = m, (fingerprint(m), tuple(hooks))
    counts = Counter(prints.values())
    repeated = {fqn for fqn in eligible if counts[prints[fqn]] > 1}
    outermost = [fqn for fqn in eligible if fqn in repeated and not _ancestors(fqn) & repeated]
    counts = Counter(prints[fqn] for fqn in outermost)  # (a final norm like the blocks' is not)
    return {fqn: eligible[fqn] for fqn in outermost if counts[prints[fqn]] > 1}


def _ancestors(fqn: str) -> set[str]:
    parts = fqn.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


@dataclass(frozen=True)
class _Meta:
    """A tensor as a template's key and fake values see it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> _Meta:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass
class Template:
    """One traced call of a repeated module: its forward and backward nodes, and how the
    module's outputs and its inputs' gradients are found among them."""

    fqn: str  # the module it was traced on
    kind: str  # its class
    graph: fx.Graph
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
class _Call:
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
            mine, theirs = node.meta["val"], arg.meta["val"]
            delta = theirs.storage_offset() - mine.storage_offset()
            self.storages.setdefault(_storage(mine), (theirs, delta))

    def seed(self, results: dict[fx.Node, fx.Node]) -> None:
        """The op's outputs (``results``: template node -> the op's output in the step's graph)
        hold the memory of the template nodes they stand for: what make_fx traced from them
        shares memory with them, so the copies do too."""
        for node, output in results.items():
            mine, theirs = node.meta["val"], output.meta["val"]
            delta = theirs.storage_offset() - mine.storage_offset()
            self.storages.setdefault(_storage(mine), (theirs, delta))


# The calls of the capture under way, by the key their op nodes hold.
_CALLS: dict[str, _Call] = {}
_serial = itertools.count()


@torch.library.custom_op("zerocc_repeat::layer", mutates_args=())
def _layer(call: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    raise CaptureError(f"the repeated-layer op of {call} ran: capture replaces it by a copy")


@_layer.register_fake
def _layer_fake(call: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_output_like(n.meta["val"]) for n in _CALLS[call].template.tensor_outputs]


@torch.library.custom_op("zerocc_repeat::layer_backward", mutates_args=())
def _layer_backward(call: str, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    raise CaptureError(f"the repeated-layer op of {call} ran: capture replaces it by a copy")


@_layer_backward.register_fake
def _layer_backward_fake(call: str, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    grads_of = _CALLS[call].template.input_grads
    return [_output_like(g.meta["val"]) for g in grads_of if g is not None]


def _output_like(t: torch.Tensor) -> torch.Tensor:
    """An op's output like the template's ``t``, on memory of the size of ``t``'s (the copies
    that share ``t``'s memory will share this one's: see :meth:`_Call.seed`)."""
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == _extent(t):
        return _Meta.of(t).empty()
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(n, dtype=t.dtype, device=t.device).as_strided(
        t.shape, t.stride(), t.storage_offset()
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.call = inputs[0]


def _backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple[None, list[Any]]:
    template = _CALLS[ctx.call].template
    with _outside_capture_modes():
        given = [
            _laid_out(grads[i], node.meta["val"])
            for i, node in zip(template.differentiable, template.grad_inputs, strict=True)
        ]
        computed = iter(torch.ops.zerocc_repeat.layer_backward(ctx.call, given))
        return None, [None if g is None else next(computed) for g in template.input_grads]


def _outside_capture_modes() -> contextlib.AbstractContextManager:
    """No torch-function mode sees what runs in the body: a repeated layer's bookkeeping
    (a tensor's shape, strides, storage) and its ops, whose templates' ops each mode saw.
    (Tensor parallelism's capture mode would fit every one of ~200k calls on the 70B
    example.)"""
    return torch._C.DisableTorchFunction()


def _laid_out(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``grad`` in the layout the template's backward was traced with (zeros for None)."""
    meta = _Meta.of(like)
    if grad is None:
        return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
    if tuple(grad.stride()) == meta.stride and grad.storage_offset() == 0:
        return grad
    return torch.ops.aten.copy.default(meta.empty(), grad)


torch.library.register_autograd("zerocc_repeat::layer", _backward, setup_context=_setup_context)
_LAYER = torch.ops.zerocc_repeat.layer.default
_LAYER_BACKWARD = torch.ops.zerocc_repeat.layer_backward.default
# The ops a call of a repeated layer is while the step is traced (a capture mode lets them
# pass: what it does to each op, the template's ops had done to them)
LAYER_OPS = frozenset(
    {torch.ops.zerocc_repeat.layer, torch.ops.zerocc_repeat.layer_backward, _LAYER, _LAYER_BACKWARD}
)
_OUTPUT_GRADS = "output_grads"  # a template's mark where backward reaches its outputs' nodes
_REFUSED_OPS = ("zerocc_opaque", "zerocc_repeat")  # namespaces a template may not hold


def _state(module: nn.Module) -> tuple[list[tuple[str, ...]], list[torch.Tensor]]:
    """The module's parameters and buffers as its call reads them: every name of each tensor
    (ties), and the tensors."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, t in named:
        names.setdefault(id(t), []).append(name)
        tensors.setdefault(id(t), t)
    return [tuple(n) for n in names.values()], list(tensors.values())


@contextlib.contextmanager
def _class_forward(module: nn.Module) -> Iterator[None]:
    """``module`` runs its class's forward in the body, not the one capture put in its place."""
    patched = module.__dict__.pop("forward")
    try:
        yield
    finally:
        module.forward = patched


class RepeatedLayers:
    """The repeated modules of one capture: the templates traced, and the calls made of them."""

    def __init__(
        self, model: nn.Module, enabled: bool = True, status: TensorStatus | None = None
    ) -> None:
        self.modules = candidates(model) if enabled else {}
        self.status = status
        # key -> the templates of calls of that kind (one per values of the scalars they read)
        self.templates: dict[Any, list[Template]] = {}
        # class -> why its calls are traced one by one (what makes a template refused is the
        # module's code, most often: its twins would be refused alike, each after a trace)
        self.refused: dict[str, str] = {}
        self.calls: list[str] = []

    @contextlib.contextmanager
    def patched(self, tracker: ModuleTracker) -> Iterator[None]:
        """Each candidate module calls :meth:`_call` in place of its forward while in the
        body."""
        mine = {f: m for f, m in self.modules.items() if "forward" not in vars(m)}  # (not opaque)
        for fqn, module in mine.items():
            module.forward = types.MethodType(self._forward_of(fqn, tracker), module)
        try:
            yield
        finally:
            for module in mine.values():
                del module.forward
            for call in self.calls:
                _CALLS.pop(call, None)

    def _forward_of(self, fqn: str, tracker: ModuleTracker) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self._call(module, fqn, tracker, args, kwargs)

        return forward

    def _call(
        self,
        module: nn.Module,
        fqn: str,
        tracker: ModuleTracker,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        kind = type(module)
        if kind.__name__ in self.refused:  # (once refused, a class is traced call by call)
            return kind.forward(module, *args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        names, state = _state(module)
        with _outside_capture_modes():
            key = self._key(module, spec, leaves, [*tensors, *state])
        if isinstance(key, str):
            template: Template | str = key
        else:
            held = self.templates.setdefault(key, [])
            template = next((t for t in held if _reads_match(module, t.reads)), None)
            if template is None:
                template = self._trace(
                    module, fqn, tracker, spec, leaves, names, [*tensors, *state]
                )
            if isinstance(template, Template) and template not in held:
                held.append(template)
        if not isinstance(template, Template):
            self.refused[kind.__name__] = template
            return kind.forward(module, *args, **kwargs)
        template.calls += 1
        call = f"{fqn}#{next(_serial)}"
        _CALLS[call] = _Call(template, fqn)
        self.calls.append(call)
        with _outside_capture_modes():
            outputs = torch.ops.zerocc_repeat.layer(call, [*tensors, *state])
        if self.status is not None:
            for t, status in zip(outputs, template.output_status, strict=True):
                self.status.set_status(t, status)
        flat = iter(outputs)
        out = [next(flat) if isinstance(o, fx.Node) else o for o in template.outputs]
        return tree_unflatten(out, template.output_spec)

    def _key(
        self,
        module: nn.Module,
        spec: TreeSpec,
        leaves: list[Any],
        tensors: list[torch.Tensor],
    ) -> tuple | str:
        """What a call must share with a template's to be its copy; why there is none when a
        non-tensor argument is no plain value (it cannot be compared: a cache object each
        layer writes into)."""
        constants = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                constants.append(None)
            elif isinstance(leaf, _PLAIN):
                constants.append(_value_key(leaf))
            else:
                kind = type(leaf).__name__
                return f"an argument is neither a tensor nor a plain value: {kind}"
        metas = tuple(_Meta.of(t) for t in tensors)
        offsets = tuple(t.storage_offset() for t in tensors)
        statuses = tuple(self._statuses(tensors))
        return fingerprint(module), spec, tuple(constants), metas, offsets, statuses

    def _statuses(self, tensors: Sequence[torch.Tensor]) -> list[Hashable]:
        if self.status is None:
            return [None] * len(tensors)
        return [self.status.status_of(t) for t in tensors]

    def _give_statuses(self, tensors: Sequence[torch.Tensor], statuses: list[Hashable]) -> None:
        if self.status is not None:
            for t, status in zip(tensors, statuses, strict=True):
                self.status.set_status(t, status)

    def _trace(
        self,
        module: nn.Module,
        fqn: str,
        tracker: ModuleTracker,
        spec: TreeSpec,
        leaves: list[Any],
        names: list[tuple[str, ...]],
        tensors: list[torch.Tensor],
    ) -> Template | str:
        """The template of this call (traced on fresh inputs, outside the step's graph), or why
        there is none."""
        if any(t.storage_offset() for t in tensors):
            return "an input is a view at an offset"
        n_call = len(tensors) - len(names)

        def run(inputs: Sequence[torch.Tensor]) -> tuple[list[Any], TreeSpec]:
            call_leaves = iter(inputs[:n_call])
            filled = [next(call_leaves) if isinstance(x, torch.Tensor) else x for x in leaves]
            args, kwargs = tree_unflatten(filled, spec)
            named = {n: t for ns, t in zip(names, inputs[n_call:], strict=True) for n in ns}
            with _class_forward(module):
                out = torch.func.functional_call(module, named, tuple(args), kwargs)
            return tree_flatten(out)

        before = fingerprint(module, scalars=True)
        statuses = self._statuses(tensors)
        output_status: list[Hashable] = []
        with disable_proxy_modes_tracing(), _reads_recorded(module) as reads:
            fresh = [_fresh_input(t) for t in tensors]
            self._give_statuses(fresh, statuses)
            probe, out_spec = run(fresh)  # which outputs are tensors, which take a gradient
            if any(not isinstance(o, (torch.Tensor, *_PLAIN)) for o in probe):
                return "an output is neither a tensor nor a plain value"
            tensor_out = [o for o in probe if isinstance(o, torch.Tensor)]
            differentiable = [i for i, o in enumerate(tensor_out) if o.requires_grad]
            grads_in = [torch.empty_like(tensor_out[i]) for i in differentiable]
            wanted = [i for i, t in enumerate(fresh) if t.requires_grad]

            def joint(*flat: torch.Tensor) -> tuple[Any, ...]:
                inputs, grads = flat[: len(fresh)], flat[len(fresh) :]
                self._give_statuses(inputs, statuses)
                outs, _ = run(inputs)
                tracker.mark(FORWARD_END)
                tensor_outs = [o for o in outs if isinstance(o, torch.Tensor)]
                output_status.extend(self._statuses(tensor_outs))
                diff = [tensor_outs[i] for i in differentiable]
                for o in diff:  # (after the tracker's pre-hooks on them)
                    if o.grad_fn is not None:
                        o.grad_fn.register_prehook(lambda grads: tracker.mark(_OUTPUT_GRADS))
                found: list[torch.Tensor | None] = [None] * len(inputs)
                if diff and wanted:
                    computed = torch.autograd.grad(
                        diff, [inputs[i] for i in wanted], list(grads), allow_unused=True
                    )
                    for i, g in zip(wanted, computed, strict=True):
                        found[i] = g
                return (*tensor_outs, *found)

            gm = make_fx(joint, tracing_mode="real", **MAKE_FX_OPTIONS)(*fresh, *grads_in)
        if fingerprint(module, scalars=True) != before:
            return "tracing its forward changed its attributes"
        gm.graph.eliminate_dead_code()
        template = _template_of(
            gm.graph, fqn, type(module).__name__, probe, out_spec, differentiable
        )
        if isinstance(template, Template):
            template.output_status, template.reads = output_status, reads
        return template

    def expand(self, gm: fx.GraphModule) -> None:
        """Replace each call's op and its backward's in ``gm`` by copies of its template."""
        with _outside_capture_modes():
            self._expand(gm.graph)

    def _expand(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target not in (_LAYER, _LAYER_BACKWARD):
                continue
            call = _CALLS[node.args[0]]
            t = call.template
            if node.target is _LAYER:
                inputs, nodes, results = t.inputs, t.forward, t.tensor_outputs
            else:
                inputs, nodes = t.grad_inputs, t.backward
                results = [g for g in t.input_grads if g is not None]
            call.bind(inputs, node.args[1])
            outputs = {user.args[1]: user for user in node.users}  # (getitems)
            call.seed({results[i]: user for i, user in outputs.items()})
            copies = _copy(graph, node, call, nodes, results)
            for i, user in outputs.items():
                user.replace_all_uses_with(copies[i])
                graph.erase_node(user)
            graph.erase_node(node)

    def summary(self) -> str:
        """What was traced once, and which classes were traced call by call and why."""
        parts = [
            f"{t.calls} {t.kind} calls traced once (on {t.fqn})"
            for held in self.templates.values()
            for t in held
        ]
        parts += [f"{kind} traced per call ({why})" for kind, why in self.refused.items()]
        return "; ".join(parts)


def _fresh_input(t: torch.Tensor) -> torch.Tensor:
    fresh = _Meta.of(t).empty()
    return fresh.requires_grad_(t.requires_grad)


def _template_of(
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
    refused = [n for n in body if _namespace(n.target) in _REFUSED_OPS]
    if refused:
        return f"it holds {refused[0].target}"
    if _writes_inputs(body, inputs_all):
        return "its forward or backward writes into an input"
    position = {n: i for i, n in enumerate(nodes)}
    forward = [n for n in body if position[n] < position[end]]
    backward = [n for n in body if position[n] > position[end]]
    # The marks before the first _OUTPUT_GRADS come from pre-hooks on the autograd nodes of the
    # module's outputs, where the step's graph has its own (of the module and of any ancestor
    # that returns the same tensor: the last of them names the ops that follow).
    first = next((i for i, n in enumerate(backward) if _is_mark(n, _OUTPUT_GRADS)), None)
    if first is None:  # (no output takes a gradient: nothing ran backward)
        if any(n.target is not mark_node for n in backward):
            return "its backward began elsewhere than at its outputs"
        first = len(backward)
    backward = [n for n in backward[first:] if not _is_mark(n, _OUTPUT_GRADS)]
    (returned,) = graph.output_node().args
    tensor_nodes = iter(returned[:n_tensor_out])
    outputs = [next(tensor_nodes) if isinstance(o, torch.Tensor) else o for o in probe]
    if any(not isinstance(o, fx.Node) for o in returned[:n_tensor_out]):
        return "an output is no traced tensor"
    input_grads = list(returned[n_tensor_out:])
    return Template(
        fqn,
        kind,
        graph,
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


def _copy(
    graph: fx.Graph,
    anchor: fx.Node,
    call: _Call,
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


def _give_values(valued: list[tuple[fx.Node, Any]], call: _Call) -> None:
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


def _value_like(value: Any, call: _Call) -> Any:
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


def _tensor_like(t: torch.Tensor, call: _Call) -> torch.Tensor:
    """On the meta device (in the fake mode's kernel invocation), a tensor like ``t``."""
    key = _storage(t)
    if key not in call.storages:  # memory the template's forward or backward allocates
        whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == _extent(t)
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


def _extent(t: torch.Tensor) -> int:
    """Bytes from the start of ``t``'s storage to the end of its last element."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()
