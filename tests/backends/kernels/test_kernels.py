"""The Triton kernels against the torch reference, on random data, at sizes that are not
multiples of the kernels' block. Without a GPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set by the conftest), on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from optional_deps import TRITON_PROBLEM

if TRITON_PROBLEM is not None:
    pytest.skip(f"backend.kernels: triton cannot run: {TRITON_PROBLEM}", allow_module_level=True)

from zerocc.backends.kernels import reference, triton_kernels  # noqa: E402  (imports triton)
from zerocc.engine.kernel_set import AdamWHyper  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 1000, 5003]  # the block is 1024: one partial block, several and a partial tail
# The fp32 results are the reference's up to a few ulps, not bit for bit: the arithmetic is the
# same op for op, but torch's CPU sqrt (SLEEF) is not always correctly rounded where the
# kernel's is, and torch's CUDA division by a scalar goes through its reciprocal. That is a
# relative 1e-7 or so; atol covers moments near zero.
FP32 = {"rtol": 1e-6, "atol": 1e-7}
INV_SCALE = 2.0**-10  # a power of two: unscaling is exact, so results must be equal


def _randn(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that equality is bit-identity (-0.0 vs 0.0, NaNs)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def _assert_bit_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _adamw_state(n: int, grad_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    return {
        "param": _randn(n, seed),
        "grad": _randn(n, seed + 1, grad_dtype),
        "exp_avg": _randn(n, seed + 2) * 0.1,
        "exp_avg_sq": _randn(n, seed + 3).abs() * 0.01,
    }


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=DEVICE)


OPTIONS = {  # grad_coef, weight_decay, param_copy dtype, found_inf (present but zero)
    "plain": (None, 0.0, None, None),
    "clip+decay+bf16_copy": (0.7, 0.1, torch.bfloat16, 0.0),
    "decay+fp16_copy": (None, 0.01, torch.float16, None),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_adamw_matches_reference(n, grad_dtype, step, options):
    coef, weight_decay, copy_dtype, found_inf = options
    state = _adamw_state(n, grad_dtype, seed=n + step)
    ours, ref = _clone(state), _clone(state)
    copies = {}
    for name, kernels, tensors in (("ours", triton_kernels, ours), ("ref", reference, ref)):
        copies[name] = (
            None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=DEVICE)
        )
        kernels.adamw_(
            **tensors,
            step=torch.tensor(step),
            grad_coef=None if coef is None else _scalar(coef),
            found_inf=None if found_inf is None else _scalar(found_inf),
            param_copy=copies[name],
            hyper=AdamWHyper(
                lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=weight_decay, grad_scale=0.25,
            ),
        )
    for name in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[name], ref[name], **FP32)
    _assert_bit_identical(ours["grad"], state["grad"])  # read, never written
    if copy_dtype is not None:
        # The invariant is "the copy is this kernel's param, cast": when the params differ in
        # their last bit, the copies may too.
        _assert_bit_identical(copies["ours"], ours["param"].to(copy_dtype))


def test_adamw_small_beta1_lerps_from_the_other_end():
    """With beta1 < 0.5 torch's lerp computes from the gradient's end; so does the kernel."""
    state = _adamw_state(3000, torch.float32, seed=0)
    ours, ref = _clone(state), _clone(state)
    for kernels, tensors in ((triton_kernels, ours), (reference, ref)):
        kernels.adamw_(
            **tensors,
            step=torch.tensor(3),
            grad_coef=None,
            found_inf=None,
            param_copy=None,
            hyper=AdamWHyper(
                lr=1e-2, beta1=0.3, beta2=0.99, eps=1e-8,
                weight_decay=0.0, grad_scale=1.0,
            ),
        )
    for name in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[name], ref[name], **FP32)


@pytest.mark.parametrize("n", [1, 5003])
def test_adamw_skips_on_found_inf_and_writes_the_copy_of_the_weights_as_they_are(n):
    """Nothing but the copy is written: it may be a host buffer other units' copies went
    through (the kernel-set convention, see reference.py)."""
    state = _adamw_state(n, torch.bfloat16, seed=n)
    ours = _clone(state)
    copy = _randn(n, seed=99, dtype=torch.bfloat16)
    triton_kernels.adamw_(
        **ours,
        step=torch.tensor(1),
        grad_coef=_scalar(0.5),
        found_inf=_scalar(1.0),
        param_copy=copy,
        hyper=AdamWHyper(
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.1, grad_scale=1.0,
        ),
    )
    for name, tensor in state.items():
        _assert_bit_identical(ours[name], tensor)
    _assert_bit_identical(copy, state["param"].to(torch.bfloat16))


SGD_OPTIONS = {  # momentum (None: no buffer), first step (zero buffer), grad_coef, decay, copy
    "plain": (None, False, None, 0.0, None),
    "momentum+clip+decay+bf16_copy": (0.9, False, 0.7, 0.01, torch.bfloat16),
    "first_step+fp16_copy": (0.9, True, None, 0.0, torch.float16),
}


@pytest.mark.parametrize("options", SGD_OPTIONS.values(), ids=SGD_OPTIONS.keys())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_matches_reference(n, grad_dtype, options):
    momentum, first_step, coef, weight_decay, copy_dtype = options
    state = {"param": _randn(n, seed=n), "grad": _randn(n, seed=n + 1, dtype=grad_dtype)}
    if momentum is not None:
        state["momentum_buffer"] = torch.zeros(n, device=DEVICE) if first_step else _randn(n, n + 2)
    ours, ref = _clone(state), _clone(state)
    copies = {}
    for name, kernels, tensors in (("ours", triton_kernels, ours), ("ref", reference, ref)):
        copies[name] = (
            None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=DEVICE)
        )
        kernels.sgd_(
            tensors["param"],
            tensors["grad"],
            tensors.get("momentum_buffer"),
            grad_coef=None if coef is None else _scalar(coef),
            found_inf=_scalar(0.0),
            param_copy=copies[name],
            grad_scale=0.5,
            lr=0.1,
            momentum=momentum or 0.0,
            weight_decay=weight_decay,
        )
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], **FP32)
    if copy_dtype is not None:
        _assert_bit_identical(copies["ours"], ours["param"].to(copy_dtype))


def test_sgd_skips_on_found_inf_and_writes_the_copy_of_the_weights_as_they_are():
    n = 3000
    state = {"param": _randn(n, 0), "grad": _randn(n, 1), "momentum_buffer": _randn(n, 2)}
    ours = _clone(state)
    copy = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    triton_kernels.sgd_(
        **ours,
        grad_coef=None,
        found_inf=_scalar(1.0),
        param_copy=copy,
        grad_scale=1.0,
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
    )
    for name, tensor in state.items():
        _assert_bit_identical(ours[name], tensor)
    _assert_bit_identical(copy, state["param"].to(torch.bfloat16))


def test_optimizers_reject_non_contiguous_tensors():
    param = _randn(20, 0).view(4, 5).t()
    with pytest.raises(AssertionError, match="contiguous"):
        triton_kernels.sgd_(param, param.clone(), None, None, None, None, 1.0, 0.1, 0.0, 0.0)


def _grads() -> list[torch.Tensor]:
    return [
        _randn(1, 10),
        _randn(1000, 11, torch.bfloat16),
        _randn(5003, 12, torch.float16),
        _randn(3000, 13),
    ]


# (which gradient, which element, what value): first/middle/last element, across dtypes.
NON_FINITE = {
    "inf_in_a_single_element": (0, 0, float("inf")),
    "nan_in_bf16": (1, 517, float("nan")),
    "-inf_last_of_a_partial_block": (2, 5002, float("-inf")),
    "nan_last": (3, 2999, float("nan")),
}


@pytest.mark.parametrize("bad", [None, *NON_FINITE.values()], ids=["finite", *NON_FINITE])
def test_unscale_check_matches_reference(bad):
    grads = _grads()
    if bad is not None:
        which, where, value = bad
        grads[which][where] = value
    ours, ref = [g.clone() for g in grads], [g.clone() for g in grads]
    found = triton_kernels.unscale_check_(ours, _scalar(INV_SCALE))
    expected = reference.unscale_check_(ref, _scalar(INV_SCALE))
    assert found.dtype == torch.float32 and found.shape == () and found.device == expected.device
    assert found.item() == expected.item() == (0.0 if bad is None else 1.0)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


HUGE = (3, 5, 1e30)  # finite, but its square overflows fp32: the sum is inf, the flag is not set


def test_an_empty_gradient_shard_is_finite_and_adds_nothing():
    """A rank's shard of a unit may hold no element (the reference's min/max has no identity)."""
    grads = [torch.empty(0, device=DEVICE), torch.ones(4, device=DEVICE)]
    flags = reference.nonfinite_flags(grads, 0.5, True)
    _assert_bit_identical(flags, torch.tensor([0.0, 0.0, 1.0], device=DEVICE))


@pytest.mark.parametrize("sum_squares", [False, True], ids=["flags", "flags+sum_squares"])
@pytest.mark.parametrize(
    "bad", [None, *NON_FINITE.values(), HUGE], ids=["finite", *NON_FINITE, "huge_but_finite"]
)
def test_nonfinite_flags_match_reference(bad, sum_squares):
    grads = _grads()
    if bad is not None:
        which, where, value = bad
        grads[which][where] = value
    before = [g.clone() for g in grads]
    ours = triton_kernels.nonfinite_flags(grads, 0.25, sum_squares)
    ref = reference.nonfinite_flags(grads, 0.25, sum_squares)
    n = len(grads)
    assert ours.dtype == ref.dtype == torch.float32
    assert ours.shape == ref.shape == (n + sum_squares,)
    expected = torch.zeros(n, device=DEVICE)
    if bad is not None and bad is not HUGE:
        expected[bad[0]] = 1.0
    _assert_bit_identical(ours[:n], expected)
    _assert_bit_identical(ref[:n], expected)
    if sum_squares:  # the same squares, added in another order
        torch.testing.assert_close(ours[n], ref[n], rtol=1e-6, atol=0, equal_nan=True)
        assert torch.isfinite(ref[n]) == (bad is None)
    for g, b in zip(grads, before, strict=True):  # read, never written
        _assert_bit_identical(g, b)


PACKS = {  # the tensors' dtype, the buffer's (None: the tensors')
    "fp32": (torch.float32, None),
    "fp32_to_bf16": (torch.float32, torch.bfloat16),
    "bf16_to_fp32": (torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, None),
}


@pytest.mark.parametrize("dtypes", PACKS.values(), ids=PACKS.keys())
def test_pack_matches_reference(dtypes):
    src_dtype, dtype = dtypes
    tensors = [
        _randn(15, 0, src_dtype).view(3, 5),
        None,
        _randn(5003, 1, src_dtype),
        _randn(0, 2, src_dtype),
        _randn(1, 3, src_dtype),
        None,
    ]
    numels = [15, 7, 5003, 0, 1, 2]
    numel = sum(numels) + 5  # padding at the end
    out = triton_kernels.pack(tensors, numels, numel, dtype)
    _assert_bit_identical(out, reference.pack(tensors, numels, numel, dtype))


def test_pack_accepts_strided_tensors():
    tensors = [_randn(20, 0).view(4, 5).t(), None]
    out = triton_kernels.pack(tensors, [20, 3], 24)
    _assert_bit_identical(out, reference.pack(tensors, [20, 3], 24))


def test_bf16_cast_rounds_to_nearest_even():
    """fp32 -> bf16 at the hard cases: ties (to even, both ways), the largest finite values
    (round up to inf), infinities, subnormals, signed zeros; NaN stays NaN."""
    patterns = [
        0x3F808000,  # 1 + 2^-8: a tie, rounds down to the even 1.0
        0x3F818000,  # a tie, rounds up to the even mantissa
        0x3F808001,  # just above a tie: up
        0x3F807FFF,  # just below: down
        0x7F7FFFFF,  # the largest fp32: rounds to inf in bf16
        0xFF7FFFFF,
        0x7F800000,  # inf
        0xFF800000,
        0x00000001,  # the smallest subnormal
        0x00408000,  # a subnormal tie
        0x80000000,  # -0.0
        0x00000000,
    ]
    as_int32 = [p - (1 << 32) if p >= 1 << 31 else p for p in patterns]
    x = torch.tensor(as_int32, dtype=torch.int32).view(torch.float32).to(DEVICE)
    # The default NaN, its negative, and one whose mantissa is all ones (rounding it naively
    # carries into the sign: -0.0).
    nan = torch.tensor([0x7FC00000, -0x400000, 0x7FFFFFFF], dtype=torch.int32)
    nan = nan.view(torch.float32).to(DEVICE)
    out = triton_kernels.pack([x, nan], [x.numel(), 3], x.numel() + 3, torch.bfloat16)
    _assert_bit_identical(out[: x.numel()], x.to(torch.bfloat16))
    assert out[-3:].isnan().all()
