"""Initial parameter values, one unit at a time, for real models and models on the ``meta`` device.

A model built on ``meta`` is initialized module by module: each module that holds parameters is
given real storage, seeded from the plan's seed and its own FQN (so the values depend on neither
the rank nor the world size), reset with its own ``reset_parameters()``, copied out, and sent
back to ``meta``. A rank thus never holds more than one unit's full weights. A model may
instead be given a :class:`WeightSource` (:func:`use_weights`; ``zerocc.weights_from`` binds
a model to its weight files): its meta tensors that the source has are read from it, again one
unit at a time. :func:`materialize` applies the same initialization to a whole model, in place,
which is how a user (or a test) gets the exact full model a zerocc run starts from.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from zerocc.compiler.capture import ParamInfo, describe_model
from zerocc.compiler.units import Unit
from zerocc.errors import CaptureError, CheckpointError


class WeightSource(Protocol):
    """Initial values of some of a model's tensors, by name (any alias of a tied parameter),
    read when zerocc asks for them."""

    def __contains__(self, name: object) -> bool: ...

    def read(self, name: str) -> torch.Tensor:
        """The full value of tensor ``name``, in any dtype (zerocc casts it to the tensor's)."""
        ...

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened (row-major), any dtype."""
        ...

    def describe(self) -> str:
        """One line for explain(): where the values come from."""
        ...

    def fingerprint(self) -> str:
        """What identifies the values it gives, the same on ranks that would read the same
        ones (not a path that differs from host to host): the ranks compare it before any
        reads, every rank reading its own (:class:`zerocc.runtime.step.StepRunner`)."""
        ...


# The source of each model given one; weak, so a model that goes away takes its entry along.
_SOURCES: weakref.WeakKeyDictionary[nn.Module, WeightSource] = weakref.WeakKeyDictionary()


def use_weights(model: nn.Module, source: WeightSource) -> None:
    """Read ``model``'s meta tensors that ``source`` has from it (replacing any source given
    before): at zerocc.compile, one unit at a time, and in :func:`materialize`."""
    _SOURCES[model] = source


def weight_source(model: nn.Module) -> WeightSource | None:
    """The source :func:`use_weights` gave ``model``, if any."""
    return _SOURCES.get(model)


def _read(
    source: WeightSource, name: str, like: torch.Tensor, device: torch.device
) -> torch.Tensor:
    value = source.read(name)
    if value.shape != like.shape:
        raise CheckpointError(
            f"{source.describe()}: {name} has shape {list(value.shape)}, the model's "
            f"{list(like.shape)}"
        )
    return value.to(device=device, dtype=like.dtype)


def module_seed(seed: int, fqn: str) -> int:
    """The seed of module ``fqn``'s initialization: the same on every rank and world size."""
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def _direct_items(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(``_parameters`` or ``_buffers``, name, tensor) of the module's own tensors."""
    return [
        (kind, name, t) for kind in ("_parameters", "_buffers")
        for name, t in getattr(module, kind).items() if t is not None
    ]  # fmt: skip


def _full(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def _bind(model: nn.Module, tensor_info: ParamInfo, kind: str, tensor: torch.Tensor) -> None:
    """Make every name of a (possibly tied) parameter or buffer refer to ``tensor``."""
    for alias in tensor_info.aliases:
        owner, _, name = alias.rpartition(".")
        getattr(model.get_submodule(owner), kind)[name] = tensor


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of the model is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def holds_values(model: nn.Module, fqns: Iterable[str]) -> bool:
    """Whether any of the named parameters/buffers holds real values (is not on ``meta``)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return any(not tensors[f].is_meta for f in fqns)


def _reset(module: nn.Module, fqn: str, seed: int, device: torch.device) -> None:
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise CaptureError(
            f"module {fqn or '<root>'!r} ({type(module).__name__}) holds tensors on the meta "
            "device but has no reset_parameters(); zerocc initializes meta models module by "
            "module with it. Define it, or build the model on a real device."
        )
    module.to_empty(device=device, recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, fqn))
        with torch.no_grad():
            reset()


def materialize(model: nn.Module, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Initialize a meta-device model in place exactly as zerocc initializes its shards.

    Meta tensors that the model's :class:`WeightSource` has are read from it; a module with
    other meta tensors is reset first. Tied parameters stay tied: each module is given new
    tensors, so every alias is pointed back at its parameter's first name afterwards.
    """
    device = torch.device(device)
    described = describe_model(model)
    source = weight_source(model)
    for fqn, module in model.named_modules():
        meta = [(kind, name, t) for kind, name, t in _direct_items(module) if t.is_meta]
        given = [(kind, name, t) for kind, name, t in meta if source and _full(fqn, name) in source]
        if len(given) < len(meta):
            _reset(module, fqn, seed, device)
        for kind, name, t in given:
            value = _read(source, _full(fqn, name), t, device)
            if kind == "_parameters":
                value = nn.Parameter(value, requires_grad=t.requires_grad)
            getattr(module, kind)[name] = value
    for p in described.params:
        _bind(model, p, "_parameters", model.get_parameter(p.fqn))
    return model


def initial_values(
    model: nn.Module, fqns: Iterable[str], seed: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Full values of the named parameters/buffers (canonical FQNs) on ``device``.

    Real tensors are read as they are, meta ones from the model's :class:`WeightSource` when it
    has them. Other meta ones are initialized by their owning modules, which go back to
    ``meta`` afterwards, so only the requested tensors are ever materialized. The
    result is in the order of ``fqns`` on every rank (callers broadcast its values in turn; a
    set's order follows the process's string hashes, which differ between ranks).
    """
    wanted = list(dict.fromkeys(fqns))
    wanted_set = set(wanted)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    values = {f: tensors[f].detach().to(device) for f in wanted if not tensors[f].is_meta}
    source = weight_source(model)
    if source is not None:
        for f in wanted:
            if f not in values and f in source:
                values[f] = _read(source, f, tensors[f], device)
    owners = {f.rpartition(".")[0] for f in wanted if f not in values}
    modules = dict(model.named_modules())
    for fqn in sorted(owners):
        module = modules[fqn]
        # The module's own meta tensors go back in place afterwards: the same objects, so ties
        # to other modules (an output head sharing the embedding) stay intact.
        originals = dict(module._parameters), dict(module._buffers)
        _reset(module, fqn, seed, device)
        for name, t in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            full = _full(fqn, name)
            if full in wanted_set:
                values[full] = t.detach().clone()
        module._parameters.update(originals[0])
        module._buffers.update(originals[1])
    return {f: values[f] for f in wanted}


def initial_shard(
    model: nn.Module, unit: Unit, rank: int, device: torch.device
) -> torch.Tensor | None:
    """This rank's shard of ``unit``'s flat initial weights, read from the model's
    :class:`WeightSource`: only the shard's elements of each weight are read, so a rank of
    ``n`` reads ``1/n`` of the unit. None unless the source gives every weight of the unit (the
    unit is then built whole, :func:`initial_values`)."""
    source = weight_source(model)
    tensors = dict(model.named_parameters())
    if source is None or not all(tensors[p.fqn].is_meta and p.fqn in source for p in unit.params):
        return None
    low, high = rank * unit.shard_numel, (rank + 1) * unit.shard_numel
    shard = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=device)
    for p in unit.params:
        start, stop = max(low, p.offset), min(high, p.offset + p.numel)
        if start < stop:
            values = source.read_range(p.fqn, start - p.offset, stop - p.offset)
            shard[start - low : stop - low].copy_(values)  # cast to the model's dtype
    return shard


def release_to_meta(model: nn.Module) -> None:
    """Swap the model's parameters and buffers for meta tensors, keeping ties: the TrainStep
    owns the weights once its state is built, and the model's copy is freed."""
    described = describe_model(model)
    for p in described.params:
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        _bind(model, p, "_parameters", nn.Parameter(meta, p.requires_grad))
    for b in described.buffers:
        _bind(model, b, "_buffers", torch.empty(b.shape, dtype=b.dtype, device="meta"))
