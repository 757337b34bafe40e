"""The update of a CPU shard in one pass over memory: AdamW and SGD compiled by Inductor.

An offloaded optimizer's update is the one large computation a GPU machine's host does each
step, and it is bound by memory: AdamW on an fp32 shard must read the weights, the gradient
and both moments and write three of them back and the compute copy for the device (30 bytes an
element with a bf16 copy). Run as torch's fused kernel with the gradient's scaling (1/ranks,
the clip coefficient) a pass before it, into a new tensor, and the copy a pass after, it moved
the shard three times, at 0.4× the host's copy bandwidth (BENCHMARKS.md, "The offloaded
optimizer's host update"). Here the whole update, the gradient's scaling and the copy included,
is written in torch ops and compiled by Inductor (``torch.compile``, C++ with OpenMP on the
rank's threads) into one vectorized loop: on a shard larger than the caches, 1.3-1.5× the
copy's bandwidth on this machine, 1.1-1.3× faster than torch's fused kernel and than
DeepSpeed's CPU Adam (on a shard the caches hold, torch's kernel is faster: BENCHMARKS.md).

Same signatures and semantics as :mod:`zerocc.backends.kernels.reference`, and the arithmetic
of :mod:`zerocc.backends.kernels.triton_kernels` rounding for rounding: ``torch.optim``'s op
for op, one fma (Inductor's ``fma`` prim) where torch's kernels fuse a multiply and an add,
two roundings where they do not (Inductor's C++ does not contract), IEEE sqrt and division,
the step's bias corrections computed once in double and passed as 0-dim fp32 tensors. So an
update offloaded to the host gives, bit for bit, what the GPU's update would have given, and
the reference's results up to its sqrt (SLEEF's, not always correctly rounded).
``found_inf`` lives on the host here: a nonzero flag skips the update, and the compute copy
receives ``param`` as it is.

Compiled once per process for any shard size (``dynamic=True``), per gradient and copy dtype,
and served by Inductor's on-disk cache on the next launch (about 4 s of a process's start here,
warm; the reason ``backend.kernels: auto`` keeps torch's fused kernels for a step on the CPU).
The host updates of offloaded units on a GPU machine run here wherever it compiles
(:func:`runs_on`); a step on the CPU asks for it with ``backend.kernels: one-pass``, which
fails at compile, with the reason, where it cannot compile. An update it does not take
(masters below fp32, a tensor off the CPU) runs the ``fused`` set's kernels.
The other ops of the set are the reference's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

try:  # Inductor's fma prim (one rounding, in its C++ too); a torch without it runs `fused`
    from torch._inductor.inductor_prims import fma
except ImportError:
    fma = None

from zerocc.backends.kernels import fused
from zerocc.backends.kernels.reference import (
    _copied,
    _skipped,
    lerp_weight,
    nonfinite_flags,
    pack,
    unscale_check_,
)
from zerocc.engine.kernel_set import AdamWHyper

__all__ = ["adamw_", "sgd_", "nonfinite_flags", "pack", "runs_on", "unscale_check_"]


def _scaled(grad, grad_scale, grad_coef):
    # As the reference: the gradient times 1/ranks, then times the clip coefficient.
    return grad.float() * grad_scale * grad_coef


def _adamw(param, grad, exp_avg, exp_avg_sq, copy, grad_scale, grad_coef, decay, weight, beta2,
           beta2c, bias2_sqrt, eps, neg_step_size, from_end: bool):  # fmt: skip
    # The Triton kernel's arithmetic, rounding for rounding: torch's lerp and addcmul as one
    # fma each (lerp from the end nearer its weight), addcdiv's order, IEEE sqrt and division.
    g = _scaled(grad, grad_scale, grad_coef)
    m = fma(weight, g - exp_avg, g if from_end else exp_avg)  # exp_avg.lerp_(g, 1 - beta1)
    v = fma(beta2c * g, g, exp_avg_sq * beta2)
    p = param * decay + (neg_step_size * m) / (v.sqrt() / bias2_sqrt + eps)
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if copy is not None:
        copy.copy_(p)


def _sgd(param, grad, momentum_buffer, copy, grad_scale, grad_coef, weight_decay, momentum,
         neg_lr, decays: bool):  # fmt: skip
    # As the Triton kernel: the weight decay (where there is one) and the step each one fma
    # (torch's add with alpha), the momentum a multiply and an add.
    g = _scaled(grad, grad_scale, grad_coef)
    if decays:
        g = fma(param, weight_decay, g)
    if momentum_buffer is not None:
        # The buffer starts at zero, so the first step stores g exactly, as torch's clone.
        g = momentum_buffer.mul_(momentum).add_(g)
    param.copy_(fma(g, neg_lr, param))
    if copy is not None:
        copy.copy_(param)


# Inductor splits a loop over threads when its size hint (the size it was first compiled for,
# a few elements in problem()) is large enough; a dynamic-threads loop is always parallel and
# takes the threads torch has when it runs (the rank's share, set after compiling).
OPTIONS = {"cpp.dynamic_threads": True}


@functools.cache
def _compiled(name: str) -> Callable[..., None]:
    fn = {"adamw": _adamw, "sgd": _sgd}[name]
    return torch.compile(fn, fullgraph=True, dynamic=True, options=OPTIONS)


@functools.cache
def problem() -> str | None:
    """Why the one-pass update cannot run in this process (None when it can): both loops
    compiled (or found in the cache) and run once, on a few elements, with a bf16 copy."""
    if fma is None:
        return f"torch {torch.__version__} has no Inductor fma prim (inductor_prims.fma)"
    try:
        p, g, m, v = (torch.zeros(8) for _ in range(4))
        copy = torch.empty(8, dtype=torch.bfloat16)
        hyper = AdamWHyper(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        _adamw_pass(p, g, m, v, 1, None, copy, hyper)
        _sgd_pass(p, g, m, None, copy, 1.0, 0.0, 0.9, 0.0)
    except Exception as exc:  # no C++ compiler, an Inductor that rejects it
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return None


def runs_on(device_type: str) -> bool:
    """Whether the one-pass update runs on ``device_type`` here: the CPU, where it compiles
    (see :func:`problem`)."""
    return device_type == "cpu" and problem() is None


def _takes(param: torch.Tensor, *states: torch.Tensor | None) -> bool:
    tensors = [param, *(s for s in states if s is not None)]
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _scalars(*values: float) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32) for v in values]


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
    """AdamW on one flat fp32 CPU shard, its gradient's scaling and the compute copy in the
    same loop."""
    if not _takes(param, exp_avg, exp_avg_sq) or not runs_on("cpu"):
        args = (param, grad, exp_avg, exp_avg_sq, step, grad_coef, found_inf, param_copy)
        return fused.adamw_(*args, hyper)
    if _skipped(found_inf):
        return _copied(param, param_copy)
    _adamw_pass(param, grad, exp_avg, exp_avg_sq, int(step.item()), grad_coef, param_copy,
                hyper)  # fmt: skip


def _adamw_pass(param, grad, exp_avg, exp_avg_sq, t: int, grad_coef, param_copy,
                hyper: AdamWHyper) -> None:  # fmt: skip
    """The compiled AdamW loop at step ``t``, its scalars computed once (in double)."""
    lr, beta1, beta2, eps = hyper.lr, hyper.beta1, hyper.beta2, hyper.eps
    grad_scale, weight_decay = hyper.grad_scale, hyper.weight_decay
    coef = torch.ones(()) if grad_coef is None else grad_coef.float()
    weight, from_end = lerp_weight(1 - beta1)
    scalars = _scalars(1 - lr * weight_decay, weight, beta2, 1 - beta2,
                       math.sqrt(1 - beta2**t), eps, -lr / (1 - beta1**t))  # fmt: skip
    _compiled("adamw")(param, grad, exp_avg, exp_avg_sq, param_copy, *_scalars(grad_scale), coef,
                       *scalars, from_end)  # fmt: skip


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
    """SGD on one flat fp32 CPU shard, its gradient's scaling and the compute copy in the same
    loop."""
    if not _takes(param, momentum_buffer) or not runs_on("cpu"):
        args = (param, grad, momentum_buffer, grad_coef, found_inf, param_copy)
        return fused.sgd_(*args, grad_scale, lr, momentum, weight_decay)
    if _skipped(found_inf):
        return _copied(param, param_copy)
    _sgd_pass(param, grad, momentum_buffer, grad_coef, param_copy, grad_scale, lr, momentum,
              weight_decay)  # fmt: skip


def _sgd_pass(param, grad, momentum_buffer, grad_coef, param_copy, grad_scale: float, lr: float,
              momentum: float, weight_decay: float) -> None:  # fmt: skip
    """The compiled SGD loop."""
    coef = torch.ones(()) if grad_coef is None else grad_coef.float()
    scalars = [*_scalars(grad_scale), coef, *_scalars(weight_decay, momentum, -lr)]
    _compiled("sgd")(param, grad, momentum_buffer, param_copy, *scalars, weight_decay != 0)
