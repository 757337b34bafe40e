"""Muon's update of whole matrices: the Newton-Schulz orthogonalization, step for step
``torch.optim.Muon``'s arithmetic (torch 2.9+, ``torch/optim/_muon.py``).

Muon's momentum is elementwise (:func:`muon_momentum_`, on any flat shard); its
orthogonalization needs each matrix whole (:func:`orthogonalize`, run once per matrix by the
rank that owns it, see :mod:`zerocc.compiler.passes.support.owners`); its weight update is
elementwise again (:func:`muon_apply_`), with each matrix's own rate (:func:`adjusted_ratio`).
An expert stack ``[E, d, f]`` is ``E`` matrices, each orthogonalized alone (as torch.optim.Muon
would orthogonalize each expert's ``[d, f]``): a loop over the leading dimension, so that each
expert's result is the 2-D one bit for bit (a batched matmul may sum in another order).

The ``zerocc`` ops that run these on a program's flat buffers are defined in
:mod:`zerocc.ir.owned_update_ops` and implemented here (registered with their schema).
"""

from __future__ import annotations

import math

import torch

from zerocc.ir.owned_update_ops import LIBRARY, MATRIX_FIELDS, adjusted_ratio, implements

# torch.optim.Muon's defaults (Keller Jordan's coefficients, 5 steps, eps 1e-7).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def _orthogonalize_2d(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` of one 2-D matrix (in bf16, as torch
    computes it)."""
    a, b, c = coefficients
    ortho = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def orthogonalize(
    update: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """The Newton-Schulz orthogonalization of ``update`` (``[rows, cols]``, or a stack
    ``[..., rows, cols]`` whose every matrix is orthogonalized alone), in bf16 as
    ``torch.optim.Muon`` computes it."""
    if update.dim() < 2:
        shape = tuple(update.shape)
        raise ValueError(f"Muon orthogonalizes matrices; got a tensor of shape {shape}")
    if steps >= 100:
        raise ValueError(f"ns_steps {steps}: at most 99 (torch.optim.Muon's limit)")
    if update.dim() == 2:
        return _orthogonalize_2d(update, coefficients, steps, eps)
    rows, cols = update.shape[-2:]
    stack = update.reshape(-1, rows, cols)
    out = torch.stack([_orthogonalize_2d(m, coefficients, steps, eps) for m in stack])
    return out.reshape(update.shape)


def newton_schulz_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of orthogonalizing one matrix (or a stack) of
    ``shape``: per step, with ``m = min(rows, cols)`` and ``n = max``, the Gram matrix
    (``2·m·m·n``), its square (``2·m³``) and the product with the matrix (``2·m·m·n``)."""
    rows, cols = shape[-2:]
    m, n = min(rows, cols), max(rows, cols)
    batch = math.prod(shape[:-2])
    return batch * steps * (4 * m * m * n + 2 * m**3)


def _skipped(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf.item() != 0)


@implements("muon_momentum_")
def muon_momentum_(
    buf: torch.Tensor,
    grad: torch.Tensor,
    grad_coef: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    grad_scale: float,
    momentum: float,
    nesterov: bool,
) -> torch.Tensor:
    """Muon's momentum on a flat shard (elementwise): ``buf.lerp_(g, 1 - momentum)`` and the
    update ``g.lerp(buf, momentum)`` (nesterov) or ``buf``, with ``g = grad · grad_scale
    (· grad_coef)`` in fp32. A skipped step (``found_inf``) leaves ``buf`` as it was."""
    g = grad.float() * grad_scale
    if grad_coef is not None:
        g.mul_(grad_coef)
    if _skipped(found_inf):
        return g
    wide = buf.float()
    wide.lerp_(g, 1 - momentum)
    if wide is not buf:
        buf.copy_(wide)
    return g.lerp(wide, momentum) if nesterov else wide.clone()


@implements("muon_orthogonalize")
def muon_orthogonalize(
    full: torch.Tensor,
    rank: torch.Tensor | None,
    matrices: list[int],
    ns_coefficients: list[float],
    ns_steps: int,
    eps: float,
) -> torch.Tensor:
    """A flat fp32 buffer of ``full``'s size holding, at the span of every matrix this rank
    owns, its orthogonalized update (bf16 values, exact in fp32), and zeros elsewhere: summed
    over the ranks (a reduce-scatter or an all-reduce), each matrix's comes from its owner
    alone, exactly. ``matrices``: ``MATRIX_FIELDS`` per matrix, over the unit's flat;
    ``rank``: this rank's place in the group the owners are of (None: every matrix is this
    rank's, nothing is exchanged); an owner of -1 is every rank."""
    out = torch.zeros(full.numel(), dtype=torch.float32, device=full.device)
    me = -1 if rank is None else int(rank.item())
    coefficients = (ns_coefficients[0], ns_coefficients[1], ns_coefficients[2])
    width = len(MATRIX_FIELDS)
    for i in range(0, len(matrices), width):
        offset, batch, rows, cols, owner = matrices[i : i + width]
        if me != -1 and owner not in (-1, me):
            continue
        numel = batch * rows * cols
        matrix = full[offset : offset + numel].view(batch, rows, cols)
        ortho = orthogonalize(matrix if batch > 1 else matrix[0], coefficients, ns_steps, eps)
        out[offset : offset + numel].copy_(ortho.reshape(-1))
    return out


@implements("muon_apply_")
def muon_apply_(
    param: torch.Tensor,
    ortho: torch.Tensor,
    found_inf: torch.Tensor | None,
    param_copy: torch.Tensor | None,
    lr: torch.Tensor,
    weight_decay: float,
    rank: torch.Tensor | None,
    spans: list[int],
    ratios: list[float],
) -> None:
    """Muon's weight update of each matrix's part of a flat shard (``spans``: offset, numel
    pairs over the unit's whole flat; ``rank``: this rank's shard of it, None for the whole
    flat): ``p.mul_(1 - lr · weight_decay)``, then ``p.add_(ortho, alpha=-lr · ratio)``, as
    torch.optim.Muon. ``param_copy`` receives the updated spans (mixed precision)."""
    if _skipped(found_inf):
        if param_copy is not None:
            param_copy.copy_(param)
        return
    rate = float(lr)
    size = param.numel()
    base = int(rank.item()) * size if rank is not None else 0
    for (offset, numel), ratio in zip(zip(spans[::2], spans[1::2], strict=True), ratios,
                                      strict=True):  # fmt: skip
        lo, hi = max(offset, base) - base, min(offset + numel, base + size) - base
        if lo >= hi:
            continue
        part = param[lo:hi]
        wide = part.float()
        wide.mul_(1 - rate * weight_decay)
        wide.add_(ortho[lo:hi], alpha=-(rate * ratio))
        if wide is not part:
            part.copy_(wide)
    if param_copy is not None:
        param_copy.copy_(param)


__all__ = [
    "LIBRARY",
    "adjusted_ratio",
    "muon_apply_",
    "muon_momentum_",
    "muon_orthogonalize",
    "newton_schulz_flops",
    "orthogonalize",
]
