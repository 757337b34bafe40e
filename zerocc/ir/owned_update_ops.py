"""The ops of an update that needs whole matrices (Muon), in the ``zerocc`` namespace: their
schemas and fake implementations. What they compute is
:mod:`zerocc.backends.kernels.newton_schulz`'s (registered with the schema, as the RNG ops are:
a program's op calls it through the dispatcher).

Per unit, the optimizer pass emits (:mod:`zerocc.compiler.passes.support.owned_update`):

- ``muon_momentum_`` on the rank's gradient shard: the momentum (elementwise) and the update
  it gives, a shard;
- the update's all-gather, so that every matrix is whole on its owner (stages 1-3);
- ``muon_orthogonalize``: each matrix this rank owns, orthogonalized; zeros elsewhere;
- a reduce-scatter (stages 1-3; an all-reduce at stage 0) that brings each rank its shard of
  the orthogonalized updates, each from its owner alone;
- ``muon_apply_``: the weight update of each matrix's part of the shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.library import Library

LIBRARY = Library("zerocc", "FRAGMENT")

# A matrix in muon_orthogonalize's ``matrices``: these five ints, one matrix after another.
MATRIX_FIELDS = ("offset", "batch", "rows", "cols", "owner")

SCHEMAS = {
    "muon_momentum_": (
        "muon_momentum_(Tensor(a!) buf, Tensor grad, Tensor? grad_coef, Tensor? found_inf,"
        " float grad_scale, float momentum, bool nesterov) -> Tensor"
    ),
    "muon_orthogonalize": (
        "muon_orthogonalize(Tensor full, Tensor? rank, int[] matrices, float[] ns_coefficients,"
        " int ns_steps, float eps) -> Tensor"
    ),
    "muon_apply_": (
        "muon_apply_(Tensor(a!) param, Tensor ortho, Tensor? found_inf, Tensor(b!)? param_copy,"
        " Tensor lr, float weight_decay, Tensor? rank, int[] spans, float[] ratios) -> ()"
    ),
}
OWNED_UPDATE_OPS = frozenset(SCHEMAS)
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn


def adjusted_ratio(adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """The factor Muon scales the rate by for a matrix of ``shape`` (its last two dimensions),
    as ``torch.optim.Muon``'s ``_adjust_lr`` (``None`` is ``original``)."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


for _schema in SCHEMAS.values():
    LIBRARY.define(_schema)


def implements(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` is what ``zerocc.<name>`` (one of :data:`SCHEMAS`) computes."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


@torch.library.register_fake("zerocc::muon_momentum_")
def _(buf, grad, grad_coef, found_inf, grad_scale, momentum, nesterov):
    return torch.empty_like(buf, dtype=torch.float32)


@torch.library.register_fake("zerocc::muon_orthogonalize")
def _(full, rank, matrices, ns_coefficients, ns_steps, eps):
    return full.new_empty(full.numel(), dtype=torch.float32)


@torch.library.register_fake("zerocc::muon_apply_")
def _(param, ortho, found_inf, param_copy, lr, weight_decay, rank, spans, ratios):
    return None
