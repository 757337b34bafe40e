"""Initial parameter values, one unit at a time, for real models and models on the ``meta`` device.

A model built on ``meta`` is initialized module by module: each module that holds parameters is
given real storage, seeded from the plan's seed and its own FQN (so the values depend on neither
the rank nor the world size), reset with its own ``reset_parameters()``, copied out, and sent
back to ``meta``. A rank thus never holds more than one unit's full weights.
:func:`materialize` applies the same initialization to a whole model, in place, which is how a
user (or a test) gets the exact full model a zerocc run starts from.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn

from zerocc.compiler.capture import ParamInfo, describe_model
from zerocc.errors import CaptureError


def _module_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def _direct_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


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
        torch.manual_seed(_module_seed(seed, fqn))
        with torch.no_grad():
            reset()


def materialize(model: nn.Module, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Initialize a meta-device model in place exactly as zerocc initializes its shards.

    Tied parameters stay tied: ``to_empty`` gives each module new tensors, so every alias is
    pointed back at its parameter's first name afterwards.
    """
    device = torch.device(device)
    described = describe_model(model)
    for fqn, module in model.named_modules():
        if any(t.is_meta for t in _direct_tensors(module)):
            _reset(module, fqn, seed, device)
    for p in described.params:
        _bind(model, p, "_parameters", model.get_parameter(p.fqn))
    return model


def initial_values(
    model: nn.Module, fqns: Iterable[str], seed: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Full values of the named parameters/buffers (canonical FQNs) on ``device``.

    Real tensors are read as they are. Meta ones are initialized by their owning modules, which
    go back to ``meta`` afterwards, so only the requested tensors are ever materialized. The
    result is in the order of ``fqns`` on every rank (callers broadcast its values in turn; a
    set's order follows the process's string hashes, which differ between ranks).
    """
    wanted = list(dict.fromkeys(fqns))
    wanted_set = set(wanted)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    values = {f: tensors[f].detach().to(device) for f in wanted if not tensors[f].is_meta}
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
            full = f"{fqn}.{name}" if fqn else name
            if full in wanted_set:
                values[full] = t.detach().clone()
        module._parameters.update(originals[0])
        module._buffers.update(originals[1])
    return {f: values[f] for f in wanted}


def release_to_meta(model: nn.Module) -> None:
    """Swap the model's parameters and buffers for meta tensors, keeping ties: the TrainStep
    owns the weights once its state is built, and the model's copy is freed."""
    described = describe_model(model)
    for p in described.params:
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        _bind(model, p, "_parameters", nn.Parameter(meta, p.requires_grad))
    for b in described.buffers:
        _bind(model, b, "_buffers", torch.empty(b.shape, dtype=b.dtype, device="meta"))
