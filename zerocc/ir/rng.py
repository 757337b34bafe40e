"""RNG replay: the generator-state ops that let a recomputed random op draw what its forward drew.

The recompute pass saves the state of the default generator of a random op's device right
before the op runs in forward (``rng_state``); before the op's copy runs in backward it saves
the generator's current state, sets the saved one (``set_rng_state``), runs the copy, and sets
the current one back, so the copy draws the forward's numbers and every later draw is what it
would have been without recompute: a run with recompute is bit-identical to one without.

The ops act on the generator of ``like``'s device (``torch.get_rng_state`` on CPU, the device
module's ``get_rng_state(device)`` elsewhere); states are CPU byte tensors, as torch returns
them. Nothing in a program's data flow orders them against the random ops they bracket: they
rely on program order, which the eager backend keeps and the only scheduling pass (overlap)
never changes for compute. Both are registered as side-effectful, so fx's dead-code
elimination keeps them and no pass takes two ``rng_state`` reads for one value.

Registered into the ``zerocc`` namespace with a FRAGMENT library (``zerocc.ir.ops`` owns the DEF);
importing this module registers them, which the recompute pass does.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.library import Library

from zerocc.ir.ops import fake, implements

_lib = Library("zerocc", "FRAGMENT")
_lib.define("rng_state(Tensor like) -> Tensor")
_lib.define("set_rng_state(Tensor state, Tensor like) -> ()")

# Bytes of a generator state, by device type, for the fake implementation (CUDA: seed, offset).
_STATE_NUMEL = {"cpu": torch.get_rng_state().numel(), "cuda": 16}


def _device_module(device: torch.device):
    return torch.get_device_module(device)


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator (a CPU byte tensor)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return _device_module(device).get_rng_state(device)


def set_generator_state(state: torch.Tensor, device: torch.device) -> None:
    """Set ``device``'s default generator to ``state`` (from :func:`generator_state`)."""
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        _device_module(device).set_rng_state(state, device)


def state_numel(device: torch.device) -> int:
    """Bytes of a generator state of ``device``'s type (asked of the real generator once)."""
    if device.type not in _STATE_NUMEL:
        # Ask the real generator once, outside fake mode (the fake op runs inside it).
        with unset_fake_temporarily():
            _STATE_NUMEL[device.type] = generator_state(device).numel()
    return _STATE_NUMEL[device.type]


@implements("rng_state", _lib)
def _rng_state(like: torch.Tensor) -> torch.Tensor:
    return generator_state(like.device)


@implements("set_rng_state", _lib)
def _set_rng_state(state: torch.Tensor, like: torch.Tensor) -> None:
    set_generator_state(state, like.device)


@fake("rng_state")
def _(like):
    return like.new_empty((state_numel(like.device),), dtype=torch.uint8, device="cpu")


@fake("set_rng_state")
def _(state, like):
    return None


RNG_STATE = torch.ops.zerocc.rng_state.default
SET_RNG_STATE = torch.ops.zerocc.set_rng_state.default
for _op in (RNG_STATE, SET_RNG_STATE):
    torch.fx.node.has_side_effect(_op)


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (:func:`draws`)."""
    return draws(node.target, node.args, node.kwargs)


def draws(op: object, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``op`` on ``args``/``kwargs`` draws from a random generator: an op
    torch tags ``nondeterministic_seeded`` (dropout, bernoulli, rand*, attention with dropout),
    except attention whose ``dropout_p`` is 0."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    dropout_p = call_argument(op, args, kwargs, "dropout_p")
    return not (isinstance(dropout_p, int | float) and dropout_p == 0)


def argument(node: torch.fx.Node, name: str, default: object = None) -> object:
    """The value ``node`` passes for schema argument ``name`` (positional or keyword)."""
    return call_argument(node.target, node.args, node.kwargs, name, default)


def call_argument(
    op: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str, default: object = None
) -> object:
    """The value a call of ``op`` passes for schema argument ``name`` (positional or keyword;
    ``default`` where it passes none, or ``op`` has no such argument)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[i] if i < len(args) else default
    return default
