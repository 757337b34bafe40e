"""zerocc's kernels in Triton: each update is one pass over memory.

Same functions, signatures and semantics as :mod:`zerocc.backends.kernels.reference` (read its
docstring for the conventions). An optimizer step is memory-bound, so what counts is the bytes
moved per element. The reference AdamW runs about a dozen torch ops, each reading and writing
whole shards, plus the upcast of ``grad`` and the cast of ``param_copy``; the kernel here
reads ``param``, ``grad``, ``exp_avg`` and ``exp_avg_sq`` once and writes ``param``, the two
moments and ``param_copy`` once. Per element of an fp32 shard with an fp32 grad and a bf16 copy
that is 16 bytes read and 14 written, the least any implementation can move.

What else is fused:

- ``grad_scale`` and ``grad_coef`` (the clip coefficient) are applied in registers. The scalars
  that depend on the step (bias corrections) are computed on the host from the CPU ``step``.
- ``grad_coef`` and ``found_inf`` stay on the device: the kernel loads them, so nothing waits
  for the GPU. When ``found_inf`` is nonzero every load and store is masked off but the
  weights' and ``param_copy``'s (written from the weights as they are, the kernel-set
  convention): the step is skipped without a host sync (the reference's ``.item()`` is one).
- ``unscale_check_`` multiplies and tests for inf/NaN in the same pass; ``nonfinite_flags``
  tests for inf/NaN and sums the squares for the clip in one read; ``pack`` casts while it
  copies, and zeroes only the holes and the tail instead of the whole buffer.

The arithmetic is ``torch.optim.AdamW``'s (and ``SGD``'s) op for op, in fp32: one rounding
where torch's kernels fuse a multiply-add (``lerp``, ``addcmul``, ``add`` with ``alpha``: here
``tl.fma``), two where torch rounds twice (fp contraction is off). The results still differ
from the reference in the last bit of a few elements per hundred thousand: torch's CPU
``sqrt`` (SLEEF) is not always correctly rounded and this one is, and torch's CUDA kernels
divide by a Python scalar through its reciprocal.

All tensors must be contiguous. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors
(that is how the tests run without a GPU).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from zerocc.backends.kernels.reference import lerp_weight
from zerocc.engine.kernel_set import AdamWHyper

BLOCK = 1024  # elements per program; 4 KiB of each fp32 stream
# Launch options of every kernel. No fp contraction: the kernels write the fmas torch computes
# (tl.fma) and nothing else, so a multiply and an add torch rounds separately stay separate.
_LAUNCH = {"enable_fp_fusion": False}


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """``x.to(dtype)``, with fp32 -> bf16 rounded to nearest even by hand, as torch rounds it.

    The GPU's conversion rounds the same way, but Triton's interpreter truncates, so the tests
    could not check the copy. Done by hand, the tests check what the GPU runs; a few integer
    ops per element are free in a kernel that waits on memory."""
    if dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        bits = tl.where(x != x, 0x7FC00000, bits)  # NaN stays a quiet NaN, as in torch
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    coef_ptr,
    found_inf_ptr,
    copy_ptr,
    n,
    grad_scale,
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1, or 1 - beta1 - 1 when LERP_FROM_END
    beta2,
    one_minus_beta2,
    step_size,  # lr / bias_correction1
    bias_correction2_sqrt,
    eps,
    HAS_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_COPY: tl.constexpr,
    LERP_FROM_END: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    whole = offs < n  # the copy's elements: written whether the step is skipped or not
    if HAS_FOUND_INF:
        # A skipped step masks every other load and store off. (Not `whole & (found == 0)`:
        # Triton's interpreter splats a scalar comparison back to float and rejects the `&`.)
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    mask = offs < n
    p0 = tl.load(param_ptr + offs, mask=whole if HAS_COPY else mask)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32) * grad_scale
    if HAS_COEF:
        g = g * tl.load(coef_ptr)
    p = p0
    m = tl.load(exp_avg_ptr + offs, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask)

    p = p * decay
    # torch's lerp is one fma, from the end nearer the weight (its CPU and GPU kernels agree).
    if LERP_FROM_END:
        m = tl.fma(lerp_weight, g - m, g)
    else:
        m = tl.fma(lerp_weight, g - m, m)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # addcmul, one fma on CPU and GPU alike
    # IEEE sqrt and division (Triton's defaults are approximate), in addcdiv's order.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(-step_size * m, denom)

    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_COPY:  # the update's weights, or (skipped) the weights as they are
        tl.store(copy_ptr + offs, _cast(tl.where(mask, p, p0), copy_ptr.dtype.element_ty), whole)


@triton.jit
def _sgd_kernel(
    param_ptr,
    grad_ptr,
    buf_ptr,
    coef_ptr,
    found_inf_ptr,
    copy_ptr,
    n,
    grad_scale,
    lr,
    momentum,
    weight_decay,
    HAS_BUF: tl.constexpr,
    HAS_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_COPY: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    whole = offs < n  # the copy's elements, as in the AdamW kernel
    if HAS_FOUND_INF:
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)  # skipped: only the copy is written
    mask = offs < n
    p0 = tl.load(param_ptr + offs, mask=whole if HAS_COPY else mask)
    p = p0
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32) * grad_scale
    if HAS_COEF:
        g = g * tl.load(coef_ptr)
    # torch's add with alpha is one fma (its CPU kernel calls fmadd, nvcc contracts the GPU's).
    if HAS_DECAY:
        g = tl.fma(p, weight_decay, g)
    if HAS_BUF:
        buf = tl.load(buf_ptr + offs, mask=mask) * momentum + g
        tl.store(buf_ptr + offs, buf, mask=mask)
        g = buf
    p = tl.fma(g, -lr, p)

    tl.store(param_ptr + offs, p, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, _cast(tl.where(mask, p, p0), copy_ptr.dtype.element_ty), whole)


@triton.jit
def _unscale_check_kernel(grad_ptr, inv_scale_ptr, found_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    # Every program that sees a non-finite value stores the same 1.0: no race to lose.
    tl.store(found_ptr, 1.0, mask=tl.max(bad.to(tl.int32), axis=0) > 0)
    y = x * tl.load(inv_scale_ptr)
    tl.store(grad_ptr + offs, _cast(y, grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nonfinite_flags_kernel(
    grad_ptr, flag_ptr, partial_ptr, n, scale, SUM_SQUARES: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    tl.store(flag_ptr, 1.0, mask=tl.max(bad.to(tl.int32), axis=0) > 0)  # no race: all store 1.0
    if SUM_SQUARES:
        # One partial per program, summed afterwards: a fixed order (atomics would not be).
        y = x * scale
        tl.store(partial_ptr + tl.program_id(0), tl.sum(y * y, axis=0))


@triton.jit
def _cast_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, _cast(x, dst_ptr.dtype.element_ty), mask=mask)


def _check_contiguous(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        assert t is None or t.is_contiguous(), (
            f"zerocc's Triton kernels need contiguous tensors; {name} has shape "
            f"{tuple(t.shape)} and strides {t.stride()}"
        )


def _check_fp32_state(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        assert t is None or t.dtype == torch.float32, (
            f"zerocc's Triton optimizer kernels keep fp32 state; {name} is {t.dtype}"
        )


def _check_numel(numel: int, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        assert t is None or t.numel() == numel, (
            f"{name} has {t.numel()} elements, the parameter shard {numel}"
        )


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def runs_on(device_type: str) -> bool:
    """On a GPU; on a CPU only interpreted (``TRITON_INTERPRET=1``, as the tests run them)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


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
    """AdamW on one flat fp32 shard in one kernel, the arithmetic of ``torch.optim.AdamW``."""
    _check_contiguous(
        param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, param_copy=param_copy
    )
    _check_fp32_state(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    n = param.numel()
    _check_numel(n, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, param_copy=param_copy)
    if n == 0:
        return
    t = int(step)  # a CPU tensor: no device sync
    lr, beta1, beta2, weight_decay = hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay
    weight, from_end = lerp_weight(1 - beta1)
    _adamw_kernel[_grid(n)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param if grad_coef is None else grad_coef,  # never read when absent
        param if found_inf is None else found_inf,
        param if param_copy is None else param_copy,
        n,
        # float(): Triton types a Python int as an integer, and specializes the value 1
        float(hyper.grad_scale),
        float(1 - lr * weight_decay),
        float(weight),
        float(beta2),
        float(1 - beta2),
        float(lr / (1 - beta1**t)),
        math.sqrt(1 - beta2**t),
        float(hyper.eps),
        HAS_COEF=grad_coef is not None,
        HAS_FOUND_INF=found_inf is not None,
        HAS_COPY=param_copy is not None,
        LERP_FROM_END=from_end,
        BLOCK=BLOCK,
        **_LAUNCH,
    )


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
    """SGD on one flat fp32 shard in one kernel, as ``torch.optim.SGD`` (no dampening, no
    Nesterov)."""
    _check_contiguous(
        param=param, grad=grad, momentum_buffer=momentum_buffer, param_copy=param_copy
    )
    _check_fp32_state(param=param, momentum_buffer=momentum_buffer)
    n = param.numel()
    _check_numel(n, grad=grad, momentum_buffer=momentum_buffer, param_copy=param_copy)
    if n == 0:
        return
    _sgd_kernel[_grid(n)](
        param,
        grad,
        param if momentum_buffer is None else momentum_buffer,  # never read when absent
        param if grad_coef is None else grad_coef,
        param if found_inf is None else found_inf,
        param if param_copy is None else param_copy,
        n,
        float(grad_scale),
        float(lr),
        float(momentum),
        float(weight_decay),
        HAS_BUF=momentum_buffer is not None,
        HAS_COEF=grad_coef is not None,
        HAS_FOUND_INF=found_inf is not None,
        HAS_COPY=param_copy is not None,
        HAS_DECAY=bool(weight_decay),
        BLOCK=BLOCK,
        **_LAUNCH,
    )


def unscale_check_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; return a 0-dim fp32 flag, 1.0 when
    any element of any gradient is inf or NaN (else 0.0). One kernel per gradient."""
    found = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    inv_scale = inv_scale.float()  # the kernel loads it as fp32; a no-op when it is already
    for i, g in enumerate(grads):
        _check_contiguous(**{f"grads[{i}]": g})
        if g.numel():
            _unscale_check_kernel[_grid(g.numel())](
                g, inv_scale, found, g.numel(), BLOCK=BLOCK, **_LAUNCH
            )
    return found


def nonfinite_flags(grads: list[torch.Tensor], scale: float, sum_squares: bool) -> torch.Tensor:
    """Per gradient, 1.0 when any element is inf or NaN (else 0.0); with ``sum_squares``, one
    more entry: the sum of ``(g * scale)**2`` over every gradient. One kernel per gradient reads
    it once for both (the reference reads it twice); the partial sums per block are added by
    torch, on the device: no host sync. The sum may differ from the reference's in the last
    bits (another order of addition); the flags are exact."""
    device = grads[0].device
    out = torch.zeros(len(grads) + int(sum_squares), dtype=torch.float32, device=device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for i, g in enumerate(grads):
        _check_contiguous(**{f"grads[{i}]": g})
        if not g.numel():
            continue
        grid = _grid(g.numel())
        partials = torch.empty(grid[0] if sum_squares else 0, dtype=torch.float32, device=device)
        _nonfinite_flags_kernel[grid](
            g,
            out[i:],  # a view: the kernel stores the flag at its first element
            out if not sum_squares else partials,  # never written without sum_squares
            g.numel(),
            float(scale),
            SUM_SQUARES=sum_squares,
            BLOCK=BLOCK,
            **_LAUNCH,
        )
        if sum_squares:
            total += partials.sum()
    if sum_squares:
        out[-1] = total
    return out


def pack(
    tensors: list[torch.Tensor | None],
    numels: list[int],
    numel: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One flat buffer of ``numel`` elements in ``dtype`` (default: the tensors'): each tensor,
    flattened and cast, at the sum of the ``numels`` before it; zeros where a tensor is None
    and in the padding at the end. One cast-and-copy kernel per tensor."""
    like = next((t for t in tensors if t is not None), None)
    if like is None:
        raise RuntimeError("zerocc.pack needs at least one tensor")
    out = torch.empty(numel, dtype=dtype or like.dtype, device=like.device)
    offset = 0
    for i, (t, n) in enumerate(zip(tensors, numels, strict=True)):
        dst = out[offset : offset + n]  # a view: the kernel writes from its first element
        if t is None:
            dst.zero_()
        elif n:
            assert t.numel() == n, f"tensors[{i}] has {t.numel()} elements, numels[{i}] is {n}"
            # Read-only, so a strided tensor may be copied (the reference's reshape does too).
            _cast_copy_kernel[_grid(n)](t.contiguous(), dst, n, BLOCK=BLOCK, **_LAUNCH)
        offset += n
    out[offset:].zero_()
    return out
