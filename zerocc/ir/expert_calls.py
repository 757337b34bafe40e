"""What each experts call of an expert-parallel step computes on the rows it received.

Capture registers, under the call's key, a function of the received rows, their count per
expert from each rank (``got``) and the module's state (its parameters, this rank's experts):
the experts module's own forward on those rows (:mod:`zerocc.compiler.parallel.experts`). The
ops ``experts_forward`` and ``experts_backward`` (:mod:`zerocc.ir.ops`) run it, wherever a
backend calls them; the backward runs it again with autograd and differentiates it (nothing
inside the experts is kept between forward and backward but the rows they received).
Registered for the life of the experts module it runs (the step's model holds it): a step
dropped, its calls go with its model.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerocc.ir.autograd_inside import autograd_inside_op

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
# call -> (its experts module, weakly; what the call computes given that module first)
_CALLS: dict[str, tuple[weakref.ref, Callable[..., torch.Tensor]]] = {}


def rows_key(call: str) -> str:
    """Where the rows an experts call received are kept, from its forward to its backward."""
    return f"{call}:rows"


def results_key(call: str) -> str:
    """Where its experts' results are kept until they are sent back."""
    return f"{call}:results"


def results_grad_key(call: str) -> str:
    """Where the gradients of those results are kept when they arrive, in backward."""
    return f"{call}:results_grad"


def rows_grad_key(call: str) -> str:
    """Where the gradients of the rows it received are kept until they are sent back."""
    return f"{call}:rows_grad"


def register(call: str, module: Any, forward: Callable[..., torch.Tensor]) -> None:
    """``forward(module, rows, got, state)`` is what the experts call ``call`` computes; the
    call is known as long as ``module`` lives."""
    _CALLS[call] = (weakref.ref(module), forward)
    weakref.finalize(module, _CALLS.pop, call, None)


def _of(call: str) -> ExpertsForward:
    found = _CALLS.get(call)
    module = found[0]() if found is not None else None
    if found is None or module is None:
        raise RuntimeError(
            f"zerocc: no experts call {call!r} is known: it was not captured in this process, "
            "or the model of its step is gone"
        )
    return functools.partial(found[1], module)


def experts_forward(
    call: str, rows: torch.Tensor, got: torch.Tensor, state: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The experts' results for the received ``rows``, one row each."""
    with torch.no_grad():
        return _of(call)(rows, got, state)


def experts_backward(
    call: str,
    rows: torch.Tensor,
    got: torch.Tensor,
    state: Sequence[torch.Tensor],
    grad: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gradients of ``rows`` and of each state tensor, given ``grad`` of the results: the
    forward run again with autograd. A rank that received no row gets zeros for its experts."""
    inputs = [rows.detach().requires_grad_(), *(t.detach().requires_grad_() for t in state)]
    with autograd_inside_op(), torch.enable_grad():
        out = _of(call)(inputs[0], got, inputs[1:])
    if not out.requires_grad:  # (no row received, and experts that skip what they got none of)
        return torch.zeros_like(rows), [torch.zeros_like(t) for t in state]
    found = torch.autograd.grad(out, inputs, grad.to(out.dtype), allow_unused=True)
    pairs = zip(found, inputs, strict=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in pairs]
    return grads[0], grads[1:]
