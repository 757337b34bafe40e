"""zerocc's kernels in plain torch: the reference every other kernel set is tested against.

Each function works on flat tensors of one FSDP unit (or a rank's shard of one). They are what
the ``zerocc`` ops run under ``backend.kernels: torch``, and the oracle of the Triton kernels
(:mod:`zerocc.backends.kernels.triton_kernels`).

Conventions shared by every kernel set:

- ``grad`` may be of any floating dtype (the ``precision.reduce`` dtype); arithmetic is fp32.
- The gradient the update uses is ``grad * grad_scale`` (1/(ranks × micro-batches): the
  collectives sum), times ``grad_coef`` (a 0-dim fp32 tensor: the clip coefficient) when given.
- ``found_inf`` (a 0-dim fp32 tensor, nonzero when a gradient overflowed) skips the update:
  ``param`` and the states are not written, as ``GradScaler.step`` skips ``optimizer.step()``.
- ``param_copy`` (same numel as ``param``, usually bf16/fp16) receives ``param`` cast to its
  dtype, updated or (skipped) not: the compute copy the next all-gather sends, or a host buffer
  the offload pass copies it from, which other units' copies went through before.
- ``step`` is the 1-based count of applied updates (an int64 0-dim tensor, on the CPU).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from zerocc.engine.kernel_set import AdamWHyper


def _skipped(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf.item() != 0)


def runs_on(device_type: str) -> bool:
    """Torch's own ops, so wherever torch runs: every device."""
    return True


def lerp_weight(weight: float) -> tuple[float, bool]:
    """How torch's ``lerp(start, end, weight)`` computes, as one fma: ``(w, False)`` for
    ``start + w * (end - start)``, or, from the end nearer the weight (``|weight| >= 0.5``),
    ``(w, True)`` for ``end + w * (end - start)`` with ``w = weight - 1`` rounded in fp32. For
    the kernels that write AdamW's ``exp_avg.lerp_(grad, 1 - beta1)`` out."""
    if abs(weight) >= 0.5:
        return float(torch.tensor(weight) - 1), True
    return weight, False


def _copied(param: torch.Tensor, param_copy: torch.Tensor | None) -> None:
    """A skipped update's compute copy: ``param`` as it is (see the conventions)."""
    if param_copy is not None:
        param_copy.copy_(param)


@contextlib.contextmanager
def _in_fp32(*tensors: torch.Tensor | None) -> Iterator[list[torch.Tensor | None]]:
    """The tensors in fp32 for an update's arithmetic: themselves when they are fp32; fp32
    copies, stored back (rounded once) at the end, when they are kept in a lower precision."""
    wide = [None if t is None else t.float() for t in tensors]
    yield wide
    for t, w in zip(tensors, wide, strict=True):
        if t is not None and w is not t:
            t.copy_(w)


def _effective_grad(
    grad: torch.Tensor, grad_scale: float, grad_coef: torch.Tensor | None
) -> torch.Tensor:
    g = grad.float() * grad_scale
    if grad_coef is not None:
        g.mul_(grad_coef)
    return g


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    grad_coef: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    param_copy: torch.Tensor | None,
    hyper: AdamWHyper,
) -> None:
    """AdamW on one flat fp32 shard, step for step the arithmetic of ``torch.optim.AdamW``
    (on a shard stored in bf16/fp16, ``precision.master: bf16``, the same arithmetic in fp32,
    rounded once when stored)."""
    if _skipped(found_inf):
        return _copied(param, param_copy)
    lr, beta1, beta2 = hyper.lr, hyper.beta1, hyper.beta2
    g = _effective_grad(grad, hyper.grad_scale, grad_coef)
    t = int(step.item())
    with _in_fp32(param, exp_avg, exp_avg_sq) as (p, m, v):
        p.mul_(1 - lr * hyper.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**t)
        bias_correction2_sqrt = math.sqrt(1 - beta2**t)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
        p.addcdiv_(m, denom, value=-step_size)
    if param_copy is not None:
        param_copy.copy_(param)


def sgd_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    grad_coef: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    param_copy: torch.Tensor | None,
    grad_scale: float,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> None:
    """SGD on one flat fp32 shard, as ``torch.optim.SGD`` (no dampening, no Nesterov); on a
    shard stored in bf16/fp16, the same arithmetic in fp32, rounded once when stored."""
    if _skipped(found_inf):
        return _copied(param, param_copy)
    g = _effective_grad(grad, grad_scale, grad_coef)
    with _in_fp32(param, momentum_buffer) as (p, buf):
        if weight_decay:
            g.add_(p, alpha=weight_decay)
        if buf is not None:
            # The buffer starts at zero, so the first step stores g exactly, as torch's clone.
            g = buf.mul_(momentum).add_(g)
        p.add_(g, alpha=-lr)
    if param_copy is not None:
        param_copy.copy_(param)


def unscale_check_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; return a 0-dim fp32 flag, 1.0 when
    any element of any gradient is inf or NaN (else 0.0)."""
    found = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    for g in grads:
        found = torch.maximum(found, _nonfinite(g).float())
        g.mul_(inv_scale)
    return found


def nonfinite_flags(grads: list[torch.Tensor], scale: float, sum_squares: bool) -> torch.Tensor:
    """A float32 vector: per gradient, 1.0 when any of its elements is inf or NaN (else 0.0);
    with ``sum_squares``, one more entry, the sum over every gradient of ``(g * scale)**2`` in
    fp32 (the clip's squared norm). Exact: a huge but finite gradient whose squares overflow
    makes that sum inf, never its flag."""
    out = torch.stack([_nonfinite(g) for g in grads]).float()
    if sum_squares:
        # The sum_squares op's arithmetic, so clipped plans round as they did before the check
        # (squared in place: the same values, one large allocation fewer).
        total = torch.zeros((), dtype=torch.float32, device=out.device)
        for g in grads:
            total += (g.float() * scale).square_().sum()
        out = torch.cat([out, total.reshape(1)])
    return out


def _nonfinite(g: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool: whether any element of ``g`` is inf or NaN. Exact, from one pass that
    allocates nothing of ``g``'s size: a NaN propagates to the min and the max, an inf is one
    of them (``isfinite`` would write a mask of every element: ~20x slower on a CPU)."""
    if g.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=g.device)
    low, high = torch.aminmax(g)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def pack(
    tensors: list[torch.Tensor | None],
    numels: list[int],
    numel: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One flat buffer of ``numel`` elements in ``dtype`` (default: the tensors'): each tensor,
    flattened and cast, at the sum of the ``numels`` before it; zeros where a tensor is None
    and in the padding at the end."""
    like = next((t for t in tensors if t is not None), None)
    if like is None:
        raise RuntimeError("zerocc.pack needs at least one tensor")
    out = torch.empty(numel, dtype=dtype or like.dtype, device=like.device)
    offset = 0
    for t, n in zip(tensors, numels, strict=True):
        if t is None:
            out[offset : offset + n].zero_()
        else:
            out[offset : offset + n].copy_(t.reshape(-1))
        offset += n
    out[offset:].zero_()  # only the holes and the padding are written twice, not the buffer
    return out
