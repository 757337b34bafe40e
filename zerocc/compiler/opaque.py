"""Opaque regions: modules whose forward the whole-step capture cannot trace, kept as one op.

A module whose shapes depend on the values it computes cannot be traced on fake tensors: a
mixture-of-experts layer that picks each expert's tokens with ``nonzero`` and loops in Python over
the experts that got any (transformers' ``eager`` experts) has no shapes to trace until it runs.
Capture keeps each call of such a module as one node of the graph,
``zerocc_opaque.region_forward``, whose arguments are the call's tensors and the module's
parameters and buffers, so the passes shard, gather, free and reduce those parameters as any
other's. Its backward, ``zerocc_opaque.region_backward``, runs the module's forward again with
autograd and differentiates it: nothing inside the region is kept between forward and backward
(as under activation recomputation), at the price of a second forward of the region. The
forward also returns the state its device's generator had before it ran, which the backward
sets for its recompute (and sets back after): a region that draws random numbers (dropout)
draws in backward what it drew in forward.

Output shapes: the op's fake implementation runs the module's forward on fake tensors with every
size that depends on data taken as empty (``nonzero`` finds nothing) and every scalar read from
data as zero. A layer whose output shape does not depend on its data (a mixture-of-experts
layer returns its input's shape) gets its true shapes that way; every real call checks its
outputs against them and raises :class:`~zerocc.errors.CaptureError` where they differ, so a
region whose output shape does depend on the data is never run on wrong shapes.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from zerocc.errors import CaptureError
from zerocc.ir.autograd_inside import autograd_inside_op
from zerocc.ir.rng import generator_state, set_generator_state, state_numel

# Exceptions by which fake tensors say that a value, not a shape, decides what comes next.
DATA_DEPENDENT = frozenset(
    {"DynamicOutputShapeException", "DataDependentOutputException", "GuardOnDataDependentSymNode"}
)


def data_dependent_cause(error: BaseException) -> BaseException | None:
    """The exception in ``error``'s chain that says a shape or a branch depends on a tensor's
    value, or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if type(current).__name__ in DATA_DEPENDENT:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def op_of(error: BaseException) -> str:
    """The op a data-dependence exception names (``aten.nonzero.default``), else its text."""
    func = getattr(error, "func", None) or (error.args[0] if error.args else None)
    return str(func) if isinstance(func, torch._ops.OpOverload) else str(error).split("\n")[0]


@dataclass
class Region:
    """One call of an opaque module, as the graph's op node refers to it by ``key``."""

    key: str
    fqn: str  # the module's name in the model
    kind: str  # the module's class
    owner: weakref.ref  # the module: its step's model holds it, the registry does not
    reason: str  # why it is opaque: the op whose result depends on the data
    call: TreeSpec  # of (args, kwargs), tensors replaced by their position
    constants: list[Any]  # the call's leaves that are no tensors (_TENSOR where one is)
    state: list[tuple[str, ...]]  # names (every alias) of each parameter and buffer passed
    outputs: TreeSpec | None = None
    output_meta: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)

    @property
    def module(self) -> nn.Module:
        module = self.owner()
        if module is None:
            raise RuntimeError(f"zerocc: opaque region {self.key}: the model of its step is gone")
        return module

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The module's forward on ``tensors`` (the call's tensors, then its state's), its
        outputs flattened; a non-tensor output is a CaptureError."""
        n_state = len(self.state)
        call_tensors, state = tensors[: len(tensors) - n_state], tensors[len(tensors) - n_state :]
        leaves = list(self.constants)
        positions = [i for i, c in enumerate(self.constants) if c is _TENSOR]
        for i, t in zip(positions, call_tensors, strict=True):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.call)
        named = {name: t for names, t in zip(self.state, state, strict=True) for name in names}
        with _own_forward(self.module):
            output = torch.func.functional_call(self.module, named, tuple(args), kwargs)
        flat, spec = tree_flatten(output)
        if any(not isinstance(t, torch.Tensor) for t in flat):
            kinds = ", ".join(sorted({type(t).__name__ for t in flat}))
            raise CaptureError(
                f"{self.fqn} ({self.kind}) runs as an opaque region ({self.reason}), whose "
                f"outputs must all be tensors; it returned {kinds}"
            )
        self.outputs = self.outputs or spec
        return flat


@contextlib.contextmanager
def _own_forward(module: nn.Module) -> Iterator[None]:
    """``module`` calls its class's forward in the body, not the op that capture put in its
    place (whose fake implementation runs the region)."""
    patched = module.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if patched is not None:
            module.forward = patched


_TENSOR = object()  # a tensor's place among a call's constants
# Every region captured in this process, by key: the op's implementations find it here, and
# inspection after its step is gone. Its module is held weakly (a step's model dropped, plan
# auto's candidates, goes), the rest of it (names, the call's constants) for the process.
_REGIONS: dict[str, Region] = {}
_serial = itertools.count()


def regions_in(gm: fx.GraphModule) -> list[Region]:
    """The regions whose forward ``gm`` runs, in graph order."""
    return [region for region, _ in calls_in(gm)]


def region_of(node: fx.Node) -> tuple[Region, bool] | None:
    """The region whose forward (True) or backward (False) ``node`` runs; None for any other
    node."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.zerocc_opaque.region_forward.default:
        return _REGIONS[node.args[0]], True
    if node.target is torch.ops.zerocc_opaque.region_backward.default:
        return _REGIONS[node.args[0]], False
    return None


def calls_in(gm: fx.GraphModule) -> list[tuple[Region, fx.Node]]:
    """Each region whose forward ``gm`` runs, with the node that runs it, in graph order."""
    return [
        (_REGIONS[n.args[0]], n)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.zerocc_opaque.region_forward.default
    ]


def _fresh(outputs: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` with each one that shares memory with an input copied (a custom op's
    outputs may not alias its inputs)."""
    held = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    return [
        t.clone() if t.numel() and t.untyped_storage().data_ptr() in held else t for t in outputs
    ]


@torch.library.custom_op("zerocc_opaque::region_forward", mutates_args=())
def opaque_forward(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the opaque region ``key`` on ``tensors`` (the call's, then the module's state):
    its outputs, then the state its device's generator had before (for the backward)."""
    r = _REGIONS[key]
    state = generator_state(_device(tensors))
    with torch.no_grad():
        outputs = r.run(tensors)
    found = [(tuple(t.shape), t.dtype) for t in outputs]
    if found != r.output_meta:
        raise CaptureError(
            f"{r.fqn} ({r.kind}), an opaque region ({r.reason}), returned "
            f"{_shapes(found)} where capture took {_shapes(r.output_meta)}: its output shapes "
            "depend on the data, which a compiled step cannot hold; make them fixed (e.g. pad "
            "to a capacity) or run the model eagerly"
        )
    return [*_fresh(outputs, tensors), state]


def _shapes(meta: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in meta)


@opaque_forward.register_fake
def _opaque_forward_fake(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    r = _REGIONS[key]
    with torch.no_grad(), _SizesTakenAsEmpty():
        outputs = r.run(tensors)
    r.output_meta = [(tuple(t.shape), t.dtype) for t in outputs]
    state = torch.empty(state_numel(_device(tensors)), dtype=torch.uint8, device="cpu")
    return [*(torch.empty_like(t) for t in outputs), state]


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device whose generator a region draws from: its tensors'."""
    return tensors[0].device if tensors else torch.device("cpu")


@torch.library.custom_op("zerocc_opaque::region_backward", mutates_args=())
def opaque_backward(
    key: str,
    wanted: list[int],
    tensors: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: torch.Tensor,
) -> list[torch.Tensor]:
    """Gradients of the region ``key``'s outputs (given ``grads``) with respect to its
    ``tensors`` at the positions ``wanted``: its forward recomputed with autograd, drawing the
    random numbers its forward drew (its generator set to ``state``, then set back)."""
    r = _REGIONS[key]
    inputs = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(tensors)]
    device = _device(tensors)
    now = generator_state(device)
    set_generator_state(state, device)
    try:
        with autograd_inside_op(), torch.enable_grad():
            outputs = r.run(inputs)
    finally:
        set_generator_state(now, device)
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    found = torch.autograd.grad(
        [o for o, _ in pairs],
        [inputs[i] for i in wanted],
        [g for _, g in pairs],
        allow_unused=True,
    ) if pairs else [None] * len(wanted)  # fmt: skip
    result = [
        g if g is not None else torch.zeros_like(inputs[i])
        for i, g in zip(wanted, found, strict=True)
    ]
    return _fresh(result, [*tensors, *grads])


@opaque_backward.register_fake
def _opaque_backward_fake(
    key: str,
    wanted: list[int],
    tensors: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: torch.Tensor,
) -> list[torch.Tensor]:
    return [torch.empty_like(tensors[i]) for i in wanted]


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
    ctx.count = len(tensors)
    ctx.save_for_backward(*tensors, output[-1])  # (the last output: the generator's state)


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[None, list[torch.Tensor | None]]:
    *tensors, state = ctx.saved_tensors
    found = torch.ops.zerocc_opaque.region_backward(
        ctx.key, ctx.wanted, tensors, list(grads[:-1]), state
    )
    result: list[torch.Tensor | None] = [None] * ctx.count
    for i, g in zip(ctx.wanted, found, strict=True):
        result[i] = g
    return None, result


opaque_forward.register_autograd(_backward, setup_context=_save_inputs)


class _SizesTakenAsEmpty(TorchDispatchMode):
    """While a region's outputs are found on fake tensors: an op whose output size depends on
    the data returns an empty result, and a scalar read from data is zero."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ not in DATA_DEPENDENT:
                raise
            return _empty_result(func, args, kwargs, e)


def _empty_result(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception
) -> Any:
    """What an op whose result depends on the data returns while a region's outputs are found:
    nothing found (``nonzero``, ``masked_select``, ``x[mask]``, ``unique``), nothing counted
    (``bincount``),
    zero read; another such op re-raises ``error``."""
    name = func.overloadpacket.__name__
    source = args[0]
    if name in ("nonzero", "argwhere"):
        return source.new_empty((0, source.dim()), dtype=torch.long)
    if name == "masked_select":
        return source.new_empty((0,))
    masks = [i for i in (args[1] if name == "index" else []) if i is not None]
    if len(masks) == 1 and masks[0].dtype == torch.bool:  # x[mask]: no element selected
        at = list(args[1]).index(masks[0])
        kept = (*source.shape[:at], 0, *source.shape[at + masks[0].dim() :])
        return source.new_empty(kept)
    if name == "bincount":
        minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
        dtype = torch.long if weights is None else weights.dtype
        return source.new_zeros((minlength,), dtype=dtype)
    if name == "_unique2":  # (values, inverse, counts)
        inverse = source.new_zeros(source.shape, dtype=torch.long)
        return source.new_empty((0,)), inverse, source.new_empty((0,), dtype=torch.long)
    if name == "_local_scalar_dense":
        return False if source.dtype == torch.bool else 0 if not source.is_floating_point() else 0.0
    raise error


@contextlib.contextmanager
def opaque_modules(
    model: nn.Module,
    classes: dict[str, str],
    hooks_paused: Any,
) -> Iterator[list[Region]]:
    """While capture traces: each module of ``model`` whose class is a key of ``classes``
    (the class name, and the reason) calls itself as one ``zerocc_opaque.region_forward`` op.
    ``hooks_paused()``: a context in which capture's module hooks mark nothing (they would
    fire inside the fake implementation). Yields the regions its calls register."""
    regions: list[Region] = []
    patched = [(fqn, m) for fqn, m in model.named_modules() if type(m).__name__ in classes]
    for fqn, module in patched:
        reason = classes[type(module).__name__]
        module.forward = _opaque_call(fqn, module, reason, regions, hooks_paused)
    try:
        yield regions
    finally:
        for _, module in patched:
            del module.forward  # the class's forward again


def _opaque_call(
    fqn: str,
    module: nn.Module,
    reason: str,
    regions: list[Region],
    hooks_paused: Any,
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        leaves, call = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
        named = itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        )
        for name, t in named:
            by_id.setdefault(id(t), ([], t))[0].append(name)
        key = f"{fqn}#{next(_serial)}"
        state = [tuple(n) for n, _ in by_id.values()]
        kind = type(module).__name__
        r = Region(key, fqn, kind, weakref.ref(module), reason, call, constants, state)
        _REGIONS[key] = r
        regions.append(r)
        with hooks_paused():
            *flat, _ = torch.ops.zerocc_opaque.region_forward(
                key, [*tensors, *(t for _, t in by_id.values())]
            )
        return tree_unflatten(flat, r.outputs)

    return forward


def forget(regions: Iterable[Region]) -> None:
    """Drop ``regions`` from the registry: calls that ran but are in no program (a forward run
    to learn its shapes, not traced)."""
    for r in regions:
        _REGIONS.pop(r.key, None)


def region_lines(programs: Iterable[fx.GraphModule]) -> list[str]:
    """A line on the opaque regions the programs run (none without any): which modules, why,
    and what it costs."""
    regions = [r for gm in programs for r in regions_in(gm)]
    if not regions:
        return []
    modules: dict[tuple[str, str], set[str]] = {}
    for r in regions:
        modules.setdefault((r.kind, r.reason), set()).add(r.fqn)
    kinds = "; ".join(f"{kind} ×{len(fqns)} ({why})" for (kind, why), fqns in modules.items())
    return [
        f"opaque regions: {kinds}: each call runs as one op (its parameters sharded, gathered "
        "and reduced as any other's), its forward run again in backward; nothing inside it is "
        "compiled or overlapped, and its compute is not in the predicted step time (an experts "
        "module's matmuls are)"
    ]
