"""Repeated layers: a layer whose twins run alike is traced once; its other calls are copies.

Which layers are twins: :mod:`zerocc.compiler.twins`; templates and their copies:
:mod:`zerocc.compiler.repeat_copies`; here, the capture's side: the ops that stand for the
calls while the step is traced, the templates traced, and the copies put in their place.

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
(:func:`~zerocc.compiler.twins.fingerprint`: its submodules' classes and attributes, its
parameters' and buffers' names, shapes and dtypes; scalar attributes by name), shares no
submodule with the rest of the model, has no hooks but ones that say they run alike for each
twin (none registered since the step began, checked at each call: a forward may register hooks
on its first call), and lies in no other candidate. A call is a copy of a template when the module's
fingerprint, the call's structure and non-tensor arguments, each tensor's shape, strides,
dtype, device and ``requires_grad``, and the scalar attributes the template's trace read are
the template's (a Hugging Face decoder layer's ``layer_idx`` differs per layer, and training
reads it not). A template is refused, and its class traced call by call, when tracing it
changed the module's attributes, it writes into an input, it holds an opaque region or a tensor
constant, or an argument is a view at an offset or no plain value (a KV cache):
:meth:`RepeatedLayers.summary` says which and why (``zerocc inspect`` prints it under capture).
Tensor parallelism's split forwards and sequence gathers, put in place per layer, say what
makes them differ from their twins' (:class:`~zerocc.compiler.twins.RepeatKeyed`), and what
sequence parallelism knows of each tensor is carried through templates and copies
(:class:`TensorStatus`). What a fingerprint cannot see is state outside the module (a global
the forward reads and changes): a model whose layers differ that way is compiled with
``capture.repeated_layers: false``.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from zerocc.compat import MAKE_FX_OPTIONS
from zerocc.compiler.module_marks import FORWARD_END, ModuleTracker
from zerocc.compiler.repeat_copies import (
    OUTPUT_GRADS,
    Call,
    Layout,
    Template,
    copy_into,
    extent,
    template_of,
)
from zerocc.compiler.twins import (
    PLAIN,
    candidates,
    fingerprint,
    hook_ids,
    reads_match,
    reads_recorded,
    value_key,
)
from zerocc.errors import CaptureError


class TensorStatus(Protocol):
    """What a capture mode knows of each tensor beyond its metadata (sequence parallelism:
    whether it is a chunk of the sequence), which a template's inputs and a copy's outputs
    must be given as the call's and the template's had."""

    def status_of(self, t: torch.Tensor) -> Hashable: ...

    def set_status(self, t: torch.Tensor, status: Hashable) -> None: ...


# The calls of the capture under way, by the key their op nodes hold.
_CALLS: dict[str, Call] = {}
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
    that share ``t``'s memory will share this one's: see :meth:`Call.seed`)."""
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == extent(t):
        return Layout.of(t).empty()
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
    meta = Layout.of(like)
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
        self.hooks: dict[str, frozenset[int]] = {}  # FQN -> its hooks' ids as the step began

    @contextlib.contextmanager
    def patched(self, tracker: ModuleTracker) -> Iterator[None]:
        """Each candidate module calls :meth:`_call` in place of its forward while in the
        body."""
        mine = {f: m for f, m in self.modules.items() if "forward" not in vars(m)}  # (not opaque)
        # The hooks each holds as the step begins (the tracker's among them): one the model's
        # forward registers later is checked at its call (see :meth:`_call`)
        self.hooks = {fqn: hook_ids(module) for fqn, module in mine.items()}
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
        if kind.__name__ not in self.refused and hook_ids(module) - self.hooks[fqn]:
            # A hook registered by the forward itself, after the candidates were chosen (as
            # transformers' output capturing does, on its first call that records outputs, the
            # routers' logits of a mixture of experts): what it does for one call (keep a
            # tensor), a template would do once, on its own trace's tensors, for every copy
            self.refused[kind.__name__] = "the model's forward registered a hook in it"
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
            template = next((t for t in held if reads_match(module, t.reads)), None)
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
        _CALLS[call] = Call(template, fqn)
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
            elif isinstance(leaf, PLAIN):
                constants.append(value_key(leaf))
            else:
                kind = type(leaf).__name__
                return f"an argument is neither a tensor nor a plain value: {kind}"
        metas = tuple(Layout.of(t) for t in tensors)
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
        with disable_proxy_modes_tracing(), reads_recorded(module) as reads:
            fresh = [_fresh_input(t) for t in tensors]
            self._give_statuses(fresh, statuses)
            probe, out_spec = run(fresh)  # which outputs are tensors, which take a gradient
            if any(not isinstance(o, (torch.Tensor, *PLAIN)) for o in probe):
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
                        o.grad_fn.register_prehook(lambda grads: tracker.mark(OUTPUT_GRADS))
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
        template = template_of(
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
            copies = copy_into(graph, node, call, nodes, results)
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
    fresh = Layout.of(t).empty()
    return fresh.requires_grad_(t.requires_grad)
