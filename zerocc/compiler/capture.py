"""Capture one training step (loss, then gradients of every trainable parameter) as one fx graph.

The step is traced by ``make_fx`` on fake tensors: no parameter is ever materialized, so a model
built on the ``meta`` device captures as well as a real one. Parameters, buffers and the batch's
tensors become placeholders; the graph returns ``(loss, *grads)``, one gradient per trainable
parameter (``None`` where a parameter does not reach the loss). Every node is tagged with its
phase (forward/backward) and the module it came from. A layer whose twins run alike (a
transformer's blocks) is traced once and copied for its other calls
(:mod:`zerocc.compiler.repeats`): the same graph, in a fraction of the time.

Under mixed precision (:class:`Casts`) the step is traced as the recipe runs it: every parameter
is cast to the compute dtype where the model reads it, floating batch tensors are cast on entry,
floating buffers to their dtype where read, the loss is cast to the output dtype, and
backward is seeded with the loss scale (a placeholder) instead of 1. Autograd of those casts
gives fp32 gradients ``_to_copy(g_bf16)``; the precision pass later moves the casts to where
they are cheapest (before the all-gather, into the reduction).
"""

from __future__ import annotations

import contextlib
import math
import os
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from zerocc.compat import MAKE_FX_OPTIONS, use_lazy_graph_module
from zerocc.compiler.batch import call_arguments
from zerocc.compiler.module_marks import FORWARD_END, ModuleTracker, mark_node
from zerocc.compiler.opaque import data_dependent_cause, forget, op_of, opaque_modules
from zerocc.compiler.plan import PrecisionConfig
from zerocc.compiler.repeats import RepeatedLayers, TensorStatus
from zerocc.errors import CaptureError, PlanError
from zerocc.ir.fake_values import fake_constants
from zerocc.ir.nodes import BATCH, BUFFER, LOSS_SCALE, LOSS_SCALE_KEY, PARAM, name_placeholder, tag
from zerocc.logs import FAKE_KERNELS, quiet

LossFn = Callable[..., torch.Tensor]
# Modules (by FQN) whose forward capture replaces: each a function of the module and its call.
Forwards = Mapping[str, Callable[..., Any]]


@dataclass(frozen=True)
class Casts:
    """How a step is traced under mixed precision; every field None/False is plain fp32."""

    compute: torch.dtype | None = None  # parameters and floating batch tensors, at use
    buffers: torch.dtype | None = None  # floating buffers, at use (kept in their own dtype)
    output: torch.dtype | None = None  # the loss
    loss_scale: bool = False  # backward seeded with the loss-scale placeholder

    @classmethod
    def of(cls, precision: PrecisionConfig) -> Casts:
        """The casts a plan's precision section asks for (none unless it leaves fp32)."""
        if not precision.mixed:
            return cls()
        return cls(
            precision.dtype("param"),
            precision.dtype("buffers"),
            precision.dtype("output"),
            precision.scaling != "none",
        )

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        return _cast_floating(t, self.compute)

    def to_buffer(self, t: torch.Tensor) -> torch.Tensor:
        return _cast_floating(t, self.buffers)


def _cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model, under its first name; ``aliases`` lists every name (ties)."""

    fqn: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def owners(self) -> tuple[str, ...]:
        """FQNs of the modules that hold the parameter (several when it is tied)."""
        return tuple(a.rpartition(".")[0] for a in self.aliases)


@dataclass(frozen=True)
class ModelInfo:
    """What capture and partition need to know about the model, without touching its weights."""

    params: tuple[ParamInfo, ...]
    buffers: tuple[ParamInfo, ...]
    modules: tuple[tuple[str, str], ...]  # (fqn, class name) in registration order

    @property
    def trainable(self) -> tuple[ParamInfo, ...]:
        return tuple(p for p in self.params if p.requires_grad)


def describe_model(model: nn.Module) -> ModelInfo:
    """Parameters (with tied aliases), buffers and modules of ``model``."""

    def collect(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[ParamInfo, ...]:
        by_id: dict[int, list[str]] = {}
        first: dict[int, torch.Tensor] = {}
        for name, t in named:
            by_id.setdefault(id(t), []).append(name)
            first.setdefault(id(t), t)
        return tuple(
            ParamInfo(
                names[0],
                tuple(names),
                tuple(first[i].shape),
                first[i].dtype,
                bool(first[i].requires_grad),
            )
            for i, names in by_id.items()
        )

    params = collect(list(model.named_parameters(remove_duplicate=False)))
    buffers = collect(list(model.named_buffers(remove_duplicate=False)))
    modules = tuple((fqn, type(m).__name__) for fqn, m in model.named_modules())
    return ModelInfo(params, buffers, modules)


def default_loss_fn(model: nn.Module, *batch: Any, **named: Any) -> torch.Tensor:
    """The loss ``model(*batch, **named)`` returns: the output itself when it is a tensor, else
    where Hugging Face models put it: ``.loss`` (a ModelOutput, a dataclass, a namedtuple),
    ``["loss"]`` (a dict), or the first element (a tuple or list, as with ``return_dict=False``).
    Raises CaptureError, saying why, when the output holds no floating scalar loss there."""
    return _loss_in(model(*batch, **named))


_PASS_LOSS_FN = "pass loss_fn=(lambda model, *batch: <scalar loss>) to zerocc.compile"
_NO_LABELS = (
    "a Hugging Face model computes its loss only when the batch holds its labels, e.g. "
    "model(input_ids, labels=input_ids) for a causal LM (it shifts them)"
)


def _loss_in(output: Any) -> torch.Tensor:
    """The loss in a model's output, found as :func:`default_loss_fn` says."""
    kind = type(output).__name__
    if isinstance(output, torch.Tensor):
        loss, where = output, "the model's output"
    elif hasattr(output, "loss"):  # before Mapping: a ModelOutput is a dict without None fields
        loss, where = output.loss, f"the model's output .loss ({kind})"
    elif isinstance(output, Mapping):
        if "loss" not in output:
            keys = ", ".join(repr(k) for k in output)
            raise CaptureError(
                f"the model returned a {kind} without a 'loss' key (keys: {keys}); return the "
                f"loss under 'loss', or {_PASS_LOSS_FN}"
            )
        loss, where = output["loss"], f"the model's output ['loss'] ({kind})"
    elif isinstance(output, (tuple, list)) and output:
        loss, where = output[0], f"the first element of the model's output ({kind})"
    else:
        empty = " (empty)" if isinstance(output, (tuple, list)) else ""
        raise CaptureError(
            f"the model returned {kind}{empty}, which holds no loss: the default loss is the "
            "model's output when it is a tensor, else its .loss, its ['loss'] or its first "
            f"element; return one of those, or {_PASS_LOSS_FN}"
        )
    if loss is None:
        raise CaptureError(f"{where} is None ({_NO_LABELS}): pass the labels, or {_PASS_LOSS_FN}")
    if not _is_scalar_loss(loss):
        hint = ""
        if isinstance(output, (tuple, list)):  # a Hugging Face model's, with return_dict=False
            hint = f" ({_NO_LABELS}, and returns it first)"
        raise CaptureError(
            f"{where} is {_describe(loss)}, not a floating scalar loss{hint}: reduce it (e.g. "
            f".mean()) in the model, or {_PASS_LOSS_FN}"
        )
    return loss


def _is_scalar_loss(loss: Any) -> bool:
    return isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


@contextlib.contextmanager
def traced_grad_mode() -> Iterator[None]:
    """The autograd mode a step is captured in and its programs run in, whatever the caller's:
    grad enabled, outside inference mode.

    Capture needs it for ``torch.autograd.grad``. A program must run in the mode it was traced
    in because some kernels choose their outputs by the ambient grad mode, not by their
    arguments: on CPU, ``aten.mkldnn_rnn_layer`` (``nn.LSTM``'s forward) returns the workspace
    its backward reads only while grad is enabled, None under ``no_grad``. Running with grad
    enabled records no autograd graph as long as no input requires grad: state tensors never
    do, and batch tensors go through :func:`detach_inputs`.
    """
    with torch.inference_mode(False), torch.enable_grad():
        yield


def detach_inputs(args: Sequence[Any]) -> list[Any]:
    """A program's arguments with every tensor that requires grad (a batch the caller built
    with ``requires_grad``) detached: read as data, never recorded by autograd, so an in-place
    update of state by such a tensor leaves the state a plain tensor."""
    return [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]


class _Step(nn.Module):
    """Holds the model so ``functional_call`` can swap in fake parameters around ``loss_fn``."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        args, named = call_arguments(batch)  # (a batch given by name: the model's keywords)
        return self.loss_fn(self.model, *args, **named)


def capture(
    model: nn.Module,
    info: ModelInfo,
    loss_fn: LossFn | None,
    batch: Sequence[Any],
    device: torch.device,
    casts: Casts | None = None,
    gradients: bool = True,
    loss_check: Callable[[torch.Tensor], None] | None = None,
    forwards: Forwards | None = None,
    repeated_layers: bool = True,
    tensor_status: TensorStatus | None = None,
) -> fx.GraphModule:
    """Trace loss and gradients of ``model`` on ``batch`` into one graph, on fake tensors
    (``gradients=False``: the loss alone, a forward-only graph for evaluation, traced with the
    model in eval mode, as a training loop evaluates: dropout off, norms on running stats).
    ``loss_check``: called with the traced loss (tensor parallelism's check of what it
    depends on). ``forwards``: modules (by FQN) traced running a function of their own in
    place of their forward (expert parallelism's experts, exchanging their tokens).
    ``repeated_layers``: a module whose instances run alike is traced once and its other calls
    copied (:mod:`zerocc.compiler.repeats`); what was, in ``gm.meta["repeated_layers"]``;
    ``tensor_status``: what a capture mode knows of each tensor, which their templates and
    copies must be given (sequence parallelism's). The graph is what passes read; the module's
    generated code is not regenerated after dead code is eliminated and placeholders renamed
    (a second compile of the whole step's code): the pass manager recompiles its result."""
    casts = casts or Casts()
    loss_fn = loss_fn or default_loss_fn
    wrapper = _Step(model, loss_fn)
    trainable = [p for p in info.params if p.requires_grad]
    if not trainable:
        raise CaptureError("the model has no trainable parameter (every requires_grad is False)")
    tensor_positions = [i for i, b in enumerate(batch) if isinstance(b, torch.Tensor)]
    n_params = len(info.params)

    def step(*flat: torch.Tensor):
        params = flat[:n_params]
        loss = _check_loss(_loss_of(wrapper, info, casts, batch, flat))
        if loss_check is not None:
            loss_check(loss)
        if casts.output is not None:
            loss = loss.to(casts.output)
        ModuleTracker.mark(FORWARD_END)
        if not gradients:
            return (loss.detach(),)
        wanted = [t for p, t in zip(info.params, params, strict=True) if p.requires_grad]
        seed = flat[-1].to(loss.dtype) if casts.loss_scale else None
        grads = torch.autograd.grad(loss, wanted, grad_outputs=seed, allow_unused=True)
        return (loss.detach(), *grads)

    opaque: dict[str, str] = {}  # classes captured as opaque regions, and why
    while True:
        fake_mode = CaptureFakeMode()
        flat = _fake_inputs(fake_mode, info, [batch[i] for i in tensor_positions], device)
        if casts.loss_scale and gradients:
            with traced_grad_mode(), fake_mode:
                flat.append(torch.empty((), dtype=torch.float32, device=device))
        layers = RepeatedLayers(model, repeated_layers, tensor_status)  # (before the hooks)
        tracker = ModuleTracker(model)
        try:
            with (
                traced_grad_mode(),
                fx_traceback.preserve_node_meta(),
                fake_mode,
                contextlib.nullcontext() if gradients else _in_eval_mode(model),
                use_lazy_graph_module(True),  # its code is generated where it is read or run
                quiet(FAKE_KERNELS),  # (the error is said as a CaptureError)
                opaque_modules(model, opaque, tracker.paused),
                forwards_replaced(model, forwards),
                layers.patched(tracker),
            ):
                gm = make_fx(step, tracing_mode="real", **MAKE_FX_OPTIONS)(*flat)
                layers.expand(gm)
            break
        except (CaptureError, PlanError):  # zerocc's own, said already (a capture mode's check)
            raise
        except Exception as e:  # an error inside the user's model: say where it surfaced
            cause = data_dependent_cause(e)
            module = _innermost(model, tracker.stack)
            in_region = module is not None and type(module).__name__ in opaque
            if cause is None or module is None or in_region:
                raise _tracing_failed(e, tracker.stack, in_region) from e
            opaque[type(module).__name__] = f"{op_of(cause)}: its result depends on the data"
        finally:
            tracker.remove()
    gm.graph.eliminate_dead_code()
    gm.meta["repeated_layers"] = layers.summary()
    _tag(gm, info, tensor_positions, casts.loss_scale and gradients)
    check_no_fake_constants(gm)
    _cast_gradients_when_complete(gm)
    return gm  # its code is make_fx's: the pass manager recompiles its own result, once


def _loss_of(
    wrapper: _Step,
    info: ModelInfo,
    casts: Casts,
    batch: Sequence[Any],
    flat: Sequence[torch.Tensor],
) -> Any:
    """What the model's loss function returns for ``batch`` with parameters, buffers and the
    batch's tensors ``flat`` (:func:`_fake_inputs`' order), cast as ``casts`` says."""
    n_params, n_buffers = len(info.params), len(info.buffers)
    params, buffers = flat[:n_params], flat[n_params : n_params + n_buffers]
    batch_tensors = iter(flat[n_params + n_buffers :])
    full_batch = [casts.to_compute(next(batch_tensors)) if isinstance(b, torch.Tensor) else b
                  for b in batch]  # fmt: skip
    state = {
        f"model.{p.fqn}": casts.to_compute(t) for p, t in zip(info.params, params, strict=True)
    }
    state |= {
        f"model.{b.fqn}": casts.to_buffer(t) for b, t in zip(info.buffers, buffers, strict=True)
    }
    return torch.func.functional_call(wrapper, state, tuple(full_batch), tie_weights=True)


@contextlib.contextmanager
def forwards_replaced(model: nn.Module, forwards: Forwards | None) -> Iterator[None]:
    """Each module of ``forwards`` calls its function in place of its forward (its hooks
    still fire around it), until the context ends."""
    modules = dict(model.named_modules())
    replaced = [modules[fqn] for fqn in forwards or {}]
    for module, function in zip(replaced, (forwards or {}).values(), strict=True):
        module.forward = types.MethodType(function, module)
    try:
        yield
    finally:
        for module in replaced:
            del module.forward  # the class's forward again


def forward_on_fake(
    model: nn.Module,
    info: ModelInfo,
    loss_fn: LossFn | None,
    batch: Sequence[Any],
    device: torch.device,
    within: contextlib.AbstractContextManager[Any],
    casts: Casts | None = None,
    opaque: dict[str, str] | None = None,
    forwards: Forwards | None = None,
) -> None:
    """Run the loss of ``model`` on ``batch`` once on fake tensors, untraced: parameters of
    ``info``'s shapes, cast as ``casts`` says, the modules of ``opaque``'s classes (and the
    ``forwards``' modules running their functions), as :func:`capture` would have them.
    ``within`` (a dispatch mode, say) is entered inside the fake mode: what it learns of the
    forward costs no capture."""
    fake_mode = CaptureFakeMode()
    flat = _fake_inputs(fake_mode, info, [b for b in batch if isinstance(b, torch.Tensor)], device)
    wrapper = _Step(model, loss_fn or default_loss_fn)
    with (
        traced_grad_mode(),
        fake_mode,
        quiet(FAKE_KERNELS),
        opaque_modules(model, opaque or {}, contextlib.nullcontext) as regions,
        forwards_replaced(model, forwards),
        within,
    ):
        try:
            _loss_of(wrapper, info, casts or Casts(), batch, flat)
        finally:
            forget(regions)


def _fake_inputs(
    fake_mode: FakeTensorMode,
    info: ModelInfo,
    batch_tensors: list[torch.Tensor],
    device: torch.device,
) -> list[torch.Tensor]:
    """The traced step's inputs on fake tensors: parameters (requiring grad as the model's
    do), buffers, then the batch's tensors."""
    with traced_grad_mode(), fake_mode:  # parameters that require grad are no inference tensors
        flat = [
            torch.empty(p.shape, dtype=p.dtype, device=device).requires_grad_(p.requires_grad)
            for p in info.params
        ]
        flat += [torch.empty(b.shape, dtype=b.dtype, device=device) for b in info.buffers]
        flat += [fake_mode.from_tensor(t) for t in batch_tensors]
    return flat


def _innermost(model: nn.Module, stack: list[str]) -> nn.Module | None:
    """The innermost module running when tracing stopped, but the model itself (whose whole
    forward an opaque region would hide from the passes) or None."""
    return model.get_submodule(stack[-1]) if stack and stack[-1] else None


def _tracing_failed(e: Exception, stack: list[str], in_region: bool) -> CaptureError:
    """The CaptureError for an error raised inside the user's model while it was traced
    (``stack``: the modules that were running, outermost first; ``in_region``: the innermost
    is captured as an opaque region)."""
    cause = data_dependent_cause(e)
    if cause is None:
        where = f" in module {stack[-1]!r}" if stack and stack[-1] else ""
        return CaptureError(
            f"tracing the training step failed{where}: {type(e).__name__}: {e}{_model_code(e)}"
        )
    what = f"{op_of(cause)} depends on the values of tensors ({type(cause).__name__})"
    module = stack[-1] if stack else ""
    if in_region:
        return CaptureError(
            f"tracing the training step failed in module {module!r}, captured as an opaque "
            f"region: {what}, and zerocc found its output shapes by taking such results as "
            "empty, which this op does not allow. Compute it with fixed shapes, or split the "
            "module so that the op runs in a submodule of it"
        )
    where = f"module {module!r}" if module else "the model's forward or loss"
    return CaptureError(
        f"tracing the training step failed in {where}: {what}. zerocc traces on fake tensors, "
        "without values: Python control flow on a tensor's value (such as `if x.sum() > 0`) "
        "and shapes that depend on it are captured only inside a submodule whose outputs have "
        "fixed shapes (it runs as an opaque region), not in the model's own forward or loss. "
        "Move that part into a submodule, or compute it with fixed shapes "
        "(torch.where(mask, x, 0) instead of x[mask])"
    )


# Frames of neither the model nor its loss: torch's, zerocc's, the standard library's (but
# its site-packages, where transformers' models are), and code fx and make_fx generate.
_NOT_MODEL_CODE = tuple(
    str(folder.resolve()) + os.sep
    for folder in (Path(torch.__file__).parent, Path(__file__).parents[1])
)
_INSTALLED = tuple(
    str(Path(sysconfig.get_paths()[key]).resolve()) + os.sep for key in ("purelib", "platlib")
)
_STANDARD = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
_GENERATED = ("<string>", "<eval_with_key")


def _is_model_code(filename: str) -> bool:
    path = str(Path(filename).resolve())
    if filename.startswith(_GENERATED) or path.startswith(_NOT_MODEL_CODE):
        return False
    return path.startswith(_INSTALLED) or not path.startswith(_STANDARD)


def _model_code(e: Exception, most: int = 8) -> str:
    """The frames of the model's (and the loss's) own code in ``e``'s traceback, the
    innermost ``most`` of them, as a Python traceback shows them (``""`` where none)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_model_code(f.filename)]
    if not frames:
        return ""
    shown = "".join(traceback.format_list(frames[-most:])).rstrip()
    return f"\nwhere the model's code raised it (most recent call last):\n{shown}"


_GROUPED_MM = torch.ops.aten._grouped_mm.default  # (looked up once: dispatch runs per op)


class CaptureFakeMode(FakeTensorMode):
    """The fake tensors capture traces on. One difference from torch's: ``aten._grouped_mm``
    on the CPU takes fp32 and fp16 as the CPU kernel does (torch's fake kernel checks CUDA's
    rule, bf16 only, so a mixture-of-experts layer on grouped matmuls did not capture in fp32)."""

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM and _cpu_grouped_mm(args[0], args[1]):
            dtype = kwargs.get("out_dtype") or args[0].dtype
            as_bf16 = (args[0].to(torch.bfloat16), args[1].to(torch.bfloat16))
            return func(*as_bf16, *args[2:], **{**kwargs, "out_dtype": None}).to(dtype)
        return super().dispatch(func, types, args, kwargs)


def _cpu_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device.type == "cpu" and a.dtype == b.dtype in (torch.float32, torch.float16)


def _cast_gradients_when_complete(gm: fx.GraphModule) -> None:
    """Move each gradient's up-cast (autograd of a parameter's cast to the compute dtype) to
    right after the compute-dtype gradient it casts. Autograd runs those casts' backward last,
    as the casts ran first in forward (every parameter is cast as the step begins), so all of
    them trail backward: the shard pass, which reduces a unit's gradient once the last of them
    is computed, would then reduce every unit after backward, and no reduction would overlap
    it."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for grad in output.args[0][1:]:
        if isinstance(grad, fx.Node) and grad.target is torch.ops.aten._to_copy.default:
            (source,) = grad.all_input_nodes
            if source.op != "placeholder":  # (the placeholders stay first)
                source.append(grad)


@contextlib.contextmanager
def _in_eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` (every submodule) in eval mode while tracing, as it was after. (A training
    program is traced in the mode the user left the model in.)"""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def check_no_fake_constants(gm: fx.GraphModule) -> None:
    """CaptureError where the step reads a constant of the graph that is a fake tensor
    (:func:`~zerocc.ir.fake_values.fake_constants`): it has no value when the program runs."""
    for readers, shape in fake_constants(gm)[:1]:
        where = ", ".join(repr(m) if m else "the model's forward or loss" for m in readers)
        raise CaptureError(
            f"tracing the training step: {where} reads a tensor of shape {shape} that the "
            "traced step did not compute: Python state kept it from another trace of the "
            "model (a hook's list, a cache), and it has no value when the program runs. "
            "Compute it within the step; if a layer's hook keeps it, set "
            "capture.repeated_layers: false"
        )


def _check_loss(loss: Any) -> torch.Tensor:
    """The loss a user's loss_fn returned, as shape ``()``; CaptureError unless it is a
    floating scalar tensor (the default's loss is checked where it is found)."""
    if loss is None:
        raise CaptureError(
            f"loss_fn returned None, not a floating scalar tensor: if it returns a model "
            f"output's .loss, that is None because {_NO_LABELS}"
        )
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(
            f"loss_fn must return a floating scalar tensor, got {type(loss).__name__}"
        )
    if not _is_scalar_loss(loss):
        raise CaptureError(
            f"loss_fn must return a floating scalar tensor, got shape {tuple(loss.shape)} "
            f"dtype {loss.dtype}; reduce it (e.g. .mean()) before returning"
        )
    return loss.reshape(())


def _tag(
    gm: fx.GraphModule,
    info: ModelInfo,
    tensor_positions: list[int],
    loss_scale: bool,
) -> None:
    """Name and tag the placeholders by role; tag every other node with its phase and source
    module, as the :func:`mark_node` nodes before it say, and erase those."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roles = [(PARAM, p.fqn, "p_") for p in info.params]
    roles += [(BUFFER, b.fqn, "b_") for b in info.buffers]
    roles += [(BATCH, str(i), "batch_") for i in tensor_positions]
    if loss_scale:
        roles.append((LOSS_SCALE, LOSS_SCALE_KEY, ""))
    for node, (role, key, prefix) in zip(ph, roles, strict=True):
        name_placeholder(node, prefix + key)
        tag(node, role=role, key=key, phase="forward")
    phase, module = "forward", ""
    for node in list(gm.graph.nodes):
        if node.target is mark_node:
            kind, name = node.args
            if kind == FORWARD_END:
                phase = "backward"
            else:
                module = name
            gm.graph.erase_node(node)
        elif node.op not in ("placeholder", "output"):
            tag(node, phase=phase, module=module)
