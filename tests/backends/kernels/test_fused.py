"""The ``fused`` kernel set (torch's fused optimizer kernels) against the torch reference, on
random data, on this machine's device (the CPU's C++ kernels here, CUDA's on a GPU).

Tolerance, AdamW: 1e-6 relative (atol 1e-7 for moments near zero) after three steps on the
CPU. The fused kernel computes the same update in another order (its bias corrections and the
denominator's division fold differently), about an ulp apart on some elements; a wrong moment,
step count or skipped weight decay moves the weights by far more (the lr is 1e-2, so ~1e-4 and
up). On CUDA atol is 2e-6: its kernel forms the moments as ``beta*m + (1-beta)*g`` where
``torch.optim`` (and the reference) lerp, and where a gradient cancels the running mean that
ulp becomes a large relative error of ``m`` that ``m/sqrt(v)`` carries into the weights;
measured on an H100, 483 of 5003 elements apart by at most 6.8e-7 (3 ulps of a weight near 3;
the weights here reach |w| ≈ 4).
SGD: bit-identical (the same two operations per element).
"""

from __future__ import annotations

import pytest
import torch

from zerocc.backends.kernels import fused, reference
from zerocc.engine.kernel_set import AdamWHyper

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ADAMW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
FP32 = {"rtol": 1e-6, "atol": 2e-6 if DEVICE == "cuda" else 1e-7}

pytestmark = pytest.mark.skipif(
    not fused.runs_on(DEVICE), reason=f"this torch has no fused optimizer kernels on {DEVICE}"
)


def _randn(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype).to(DEVICE)


def _adamw(kernels, state: dict, step: int, **extra) -> None:
    args = {"grad_coef": None, "found_inf": None, "param_copy": None, "grad_scale": 1.0} | extra
    kernels.adamw_(
        state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"],
        torch.tensor(step), args["grad_coef"], args["found_inf"], args["param_copy"],
        AdamWHyper(**ADAMW, grad_scale=args["grad_scale"]),
    )  # fmt: skip


def _state(n: int, grad_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "param": _randn(n, 0),
        "grad": _randn(n, 1, grad_dtype),
        "exp_avg": torch.zeros(n, device=DEVICE),
        "exp_avg_sq": torch.zeros(n, device=DEVICE),
    }


CASES = {  # grad dtype, grad_scale, grad_coef
    "plain": (torch.float32, 1.0, None),
    "scaled": (torch.float32, 1 / 3, None),
    "clipped": (torch.float32, 0.5, 0.7),
    "bf16 grad": (torch.bfloat16, 0.25, None),
}


@pytest.mark.parametrize("case", CASES)
def test_adamw_matches_the_reference_and_leaves_the_gradient_alone(case):
    grad_dtype, grad_scale, coef = CASES[case]
    ours, theirs = _state(5003, grad_dtype), _state(5003, grad_dtype)
    grad = ours["grad"].clone()
    copies = [torch.empty(5003, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    extra = {"grad_scale": grad_scale, "found_inf": torch.zeros((), device=DEVICE)}
    if coef is not None:
        extra["grad_coef"] = torch.tensor(coef, device=DEVICE)
    for step in (1, 2, 3):
        _adamw(fused, ours, step, param_copy=copies[0], **extra)
        _adamw(reference, theirs, step, param_copy=copies[1], **extra)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[key], theirs[key], **FP32)
    assert torch.equal(ours["grad"], grad)  # torch's kernel stores an unscaled grad back
    assert torch.equal(copies[0], ours["param"].to(torch.bfloat16))


def test_a_found_inf_skips_every_write():
    state = _state(1000)
    before = {k: v.clone() for k, v in state.items()}
    # zerocc's flag counts overflows (here on two ranks); torch's kernels skip only on 1.0.
    flag = torch.full((), 2.0, device=DEVICE)
    _adamw(fused, state, 1, found_inf=flag, grad_scale=0.5)
    for key, value in before.items():
        assert torch.equal(state[key], value), key
    param, buf = _randn(1000, 3), torch.zeros(1000, device=DEVICE)
    kept = param.clone()
    fused.sgd_(param, _randn(1000, 4), buf, None, flag, None,
               0.5, 0.1, 0.9, 0.01)  # fmt: skip
    assert torch.equal(param, kept) and not buf.any()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_is_the_reference_bit_for_bit(momentum):
    ours, theirs = _randn(1000, 5), _randn(1000, 5)
    bufs = [torch.zeros(1000, device=DEVICE) if momentum else None for _ in range(2)]
    for seed in range(3):
        grad = _randn(1000, 10 + seed)
        coef = torch.tensor(0.7, device=DEVICE)
        fused.sgd_(ours, grad, bufs[0], coef, None, None, 1 / 3, 0.1, momentum, 0.01)
        reference.sgd_(theirs, grad, bufs[1], coef, None, None, 1 / 3, 0.1, momentum, 0.01)
    assert torch.equal(ours, theirs)


def test_masters_below_fp32_run_the_reference():
    """bf16 masters: the reference's fp32 arithmetic, rounded once (the fused kernel would
    round the gradient to bf16 first)."""
    ours = {k: v.to(torch.bfloat16) for k, v in _state(1000).items()}
    theirs = {k: v.clone() for k, v in ours.items()}
    _adamw(fused, ours, 1)
    _adamw(reference, theirs, 1)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
