"""Which layers of a model are twins: their forwards trace to the same graph.

The first step of :mod:`zerocc.compiler.repeats`: a layer's fingerprint (what decides the graph
its forward traces to, but for its call), the candidates it picks out, and the scalar
attributes a template's trace read (held by name in a fingerprint, compared by value per
template)."""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections import Counter
from collections.abc import Hashable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from zerocc.compiler.names import enclosing

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
PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device, enum.Enum, type)


class RepeatKeyed(Protocol):
    """An object a layer holds (a forward or a hook put in place per layer) that says what
    makes it differ from its twins' (the same for all of them when it runs alike for each,
    its layer's name apart): tensor parallelism's split forwards and sequence gathers."""

    def repeat_key(self) -> Hashable: ...


def value_key(value: Any, _within: frozenset[int] = frozenset()) -> Any:
    """What a fingerprint holds of an attribute's value: the value itself for plain data, its
    repeat key for a :class:`RepeatKeyed`, a container's items' keys, a module that holds no
    state (:func:`_stateless`) by its class and attributes' keys, the object's identity
    otherwise (two instances holding the same config object match; two holding equal but
    distinct tensors do not).

    A stateless module that a layer holds outside its submodules is what Hugging Face's
    ``kernels`` gives each instance of a layer calling a hub-replaceable function (a Llama
    attention's ``_kernel_funcs``: a fresh wrapper of ``apply_rotary_pos_emb`` per layer); by
    identity it would make every layer differ from its twins."""
    if isinstance(value, PLAIN):
        return (type(value), value)
    if callable(getattr(value, "repeat_key", None)):  # (see RepeatKeyed)
        return ("keyed", value.repeat_key())
    if isinstance(value, (tuple, list, frozenset)):
        return (type(value), tuple(value_key(v, _within) for v in value))
    if type(value) is dict:
        return (dict, tuple((value_key(k), value_key(v, _within)) for k, v in value.items()))
    if isinstance(value, nn.Module) and id(value) not in _within and _stateless(value):
        within = _within | {id(value)}
        attributes = sorted((k, v) for k, v in vars(value).items() if k not in _MODULE_INTERNALS)
        return ("module", type(value), value.training,
                tuple((k, value_key(v, within)) for k, v in attributes))  # fmt: skip
    return ("object", id(value))


def _stateless(module: nn.Module) -> bool:
    """Whether ``module`` holds no parameter, buffer, submodule or hook: what its forward
    computes is its class's and its attributes'."""
    return not (module._parameters or module._buffers or module._modules) and not any(
        getattr(module, name) for name in _HOOKS
    )


def fingerprint(module: nn.Module, scalars: bool = False) -> tuple:
    """What decides the graph ``module``'s forward traces to, but for its call and for its
    scalar attributes (numbers and strings: a Hugging Face layer's ``layer_idx``), whose
    names and types it holds, not their values (a template says which of them its trace read,
    :func:`reads_recorded`): every submodule's name, class, mode and other attributes (by
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
        (k, ("scalar", type(v)) if _is_scalar(v) and not scalars else value_key(v))
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
def reads_recorded(module: nn.Module) -> Iterator[dict[tuple[str, str], Any]]:
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


def reads_match(module: nn.Module, reads: dict[tuple[str, str], Any]) -> bool:
    """Whether ``module`` holds the values a template's trace read."""
    return all(
        getattr(module.get_submodule(name), attribute) == value
        for (name, attribute), value in reads.items()
    )


def _hooks_print(module: nn.Module) -> tuple | None:
    """The module's hooks by their repeat keys, or None when one has none (a hook a template
    cannot copy: what it does for one layer, it would do for all)."""
    keys = tuple(value_key(h) for name in _HOOKS for h in getattr(module, name, {}).values())
    return None if any(k[0] == "object" for k in keys) else keys


def hook_ids(module: nn.Module) -> frozenset[int]:
    """The ids of the hooks registered on ``module`` and its submodules (a handle's ``id``)."""
    return frozenset(
        key for s in module.modules() for name in _HOOKS for key in getattr(s, name, {})
    )


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
    outermost = [
        fqn
        for fqn in eligible
        if fqn in repeated and not any(m in repeated for m in enclosing(fqn.rpartition(".")[0]))
    ]
    counts = Counter(prints[fqn] for fqn in outermost)  # (a final norm like the blocks' is not)
    return {fqn: eligible[fqn] for fqn in outermost if counts[prints[fqn]] > 1}
