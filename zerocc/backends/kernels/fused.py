"""zerocc's updates on torch's fused optimizer kernels: one pass over memory, on any device.

``torch._fused_adamw_`` / ``torch._fused_sgd_`` are what ``torch.optim.AdamW(fused=True)`` and
``SGD(fused=True)`` run: one vectorized, multi-threaded C++ loop on a CPU (about 15× faster than
the reference's ten separate ops on one core), one multi-tensor kernel on a GPU. Both read
``found_inf`` where it lives and skip the update there, with no host sync. Same signatures and
semantics as :mod:`zerocc.backends.kernels.reference` (read its conventions), within rounding of
it: the fused kernels order the arithmetic their own way (one ulp apart on some elements), so
the reference stays the oracle that the parity tests hold bit-identical to ``torch.optim``.

Masters kept below fp32 (``precision.master: bf16``) and a device torch has no fused kernel for
run the reference; so do ``unscale_check_``, ``nonfinite_flags`` and ``pack``.
"""

from __future__ import annotations

import functools

import torch

from zerocc.backends.kernels import reference
from zerocc.backends.kernels.reference import nonfinite_flags, pack, unscale_check_
from zerocc.engine.kernel_set import AdamWHyper

__all__ = ["adamw_", "sgd_", "nonfinite_flags", "pack", "runs_on", "unscale_check_"]


@functools.cache
def runs_on(device_type: str) -> bool:
    """Whether this torch has the fused AdamW and SGD kernels for ``device_type`` (the CPU ones
    came with torch 2.4): tried once on one element."""
    if not hasattr(torch, "_fused_adamw_") or not hasattr(torch, "_fused_sgd_"):
        return False
    try:
        one = [torch.zeros(1, device=device_type) for _ in range(4)]
        step = [torch.ones((), device=device_type)]
        options = _adamw_options(0.0, 0.9, 0.9, 1.0, 0.0)
        torch._fused_adamw_(*([t] for t in one), [], step, **options)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _adamw_options(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float):
    return dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                amsgrad=False, maximize=False)  # fmt: skip


def _fused(param: torch.Tensor, *states: torch.Tensor | None) -> bool:
    """Whether the fused kernel can run this update: fp32 weights and states on a device it
    has kernels for (the reference updates other dtypes in fp32, rounding once)."""
    tensors = [param, *(s for s in states if s is not None)]
    return all(t.dtype == torch.float32 for t in tensors) and runs_on(param.device.type)


def _scaled(grad: torch.Tensor, grad_scale: float, grad_coef: torch.Tensor | None) -> torch.Tensor:
    """The gradient the update uses, in fp32: ``grad`` itself when nothing scales it (the fused
    kernels only read it then), else a scaled copy (given a scale, they would divide ``grad``
    by it and store it back, and round otherwise than the reference's product)."""
    if grad_scale == 1.0 and grad_coef is None and grad.dtype == torch.float32:
        return grad
    return reference._effective_grad(grad, grad_scale, grad_coef)


def _on(device: torch.device, found_inf: torch.Tensor | None) -> torch.Tensor | None:
    """The flag as torch's kernels read it: they skip only on exactly 1.0, while zerocc's
    flag is any nonzero count (summed over ranks and units)."""
    return None if found_inf is None else found_inf.ne(0).to(device, torch.float32)


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
    """AdamW on one flat fp32 shard, as ``torch.optim.AdamW(fused=True)``."""
    args = (param, grad, exp_avg, exp_avg_sq, step, grad_coef, found_inf, param_copy)
    if not _fused(param, exp_avg, exp_avg_sq):
        return reference.adamw_(*args, hyper)
    torch._fused_adamw_(
        [param],
        [_scaled(grad, hyper.grad_scale, grad_coef)],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step.to(param.device, torch.float32)],
        found_inf=_on(param.device, found_inf),
        **_adamw_options(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay),
    )
    if param_copy is not None:  # a skipped update rewrites the copy it already holds
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
    """SGD on one flat fp32 shard, as ``torch.optim.SGD(fused=True)`` (no dampening, no
    Nesterov; the buffer starts at zero, so its first step stores the gradient, as torch's)."""
    if not _fused(param, momentum_buffer):
        args = (param, grad, momentum_buffer, grad_coef, found_inf, param_copy)
        return reference.sgd_(*args, grad_scale, lr, momentum, weight_decay)
    torch._fused_sgd_(
        [param],
        [_scaled(grad, grad_scale, grad_coef)],
        [] if momentum_buffer is None else [momentum_buffer],
        weight_decay=weight_decay,
        momentum=momentum if momentum_buffer is not None else 0.0,
        lr=lr,
        dampening=0.0,
        nesterov=False,
        maximize=False,
        is_first_step=False,
        found_inf=_on(param.device, found_inf),
    )
    if param_copy is not None:
        param_copy.copy_(param)
