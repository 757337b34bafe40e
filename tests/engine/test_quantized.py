"""Quantized collectives (issue 51, ZeRO++'s qwZ and qgZ): stage 3's all-gathers of parameters
(``zero.quantized_weights: int8 | fp8``) and the gradients' reduce-scatters
(``zero.quantized_grads: int8 | int4``): each wire format's round-trip error bound, the bytes on
the wire, and training on 2 gloo ranks beside the same run unquantized.

Tolerances of the training comparison: each rank trains 30 AdamW steps (lr 1e-2) on one batch,
so that the loss falls (3.47 to ~0.63), and each value sent is rounded (int8: to within half a
step of its block's scale, 1/254 of the block's largest magnitude; fp8: 1/16 of its own; int4:
1/14 of the block's largest). The first step that uses a rounded value differs by that rounding
alone: within 1e-3 relative (the first loss under int8 weights, measured 3.7e-4 in fp32, bf16
losses equal; under fp8 weights 1.7e-4; the second under int8 gradients, the first update's,
measured 9e-5 in fp32, under int4 gradients 5.4e-4 (Adam's first update is ±lr wherever the
rounded gradient keeps its sign); in bf16, whose losses are rounded to 2^-6 near 3.4, within
two such steps, measured two). After it the runs' weights part, as any two runs whose weights
differ slightly do, and at a loss near 0.6 their losses differ by a few percent: the curves are
compared by the mean of their last 5 losses, within 5% (measured by rank: int8 weights
1.6-2.1% in fp32, 0.7-0.8% in bf16; fp8 weights 1.1-2.4%; int8 gradients 1.9-3.3% in fp32,
0.3-1.4% in bf16; int4 gradients 0.5-2.1%; both 1.4-2.1%), and the quantized run must learn the
batch as well.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import _gpt_batch, tiny_gpt
from multirank import run_ranks

import zerocc
from zerocc.engine.quantized import dequantize_into, quantize
from zerocc.errors import PlanError
from zerocc.ir.wire import WIRE_FORMATS, wire_format

STEPS = 30
FIRST_TOL = 1e-3
CURVE_TOL = 5e-2  # the mean of the last 5 losses


def _error_bound(wire: str, want: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a value may move in the format's round trip: half a step of its block's scale for
    the integer formats; for fp8 (e4m3), half a unit of a 3-bit mantissa (2^-4 of the value),
    and half its smallest step (2^-9 of the scale, subnormal) near zero."""
    if wire == "fp8":
        return torch.maximum(want.abs() * 2**-4, scale * 2**-10)
    return scale / 2


@pytest.mark.parametrize("wire", sorted(WIRE_FORMATS))
@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_a_round_trip_is_within_the_formats_bound_in_each_block(numel, wire):
    torch.manual_seed(0)
    how = wire_format(wire)
    shards = [torch.randn(numel) * (r + 1) for r in range(3)]
    shards[1][: min(numel, 300)] = 0  # a block of zeros comes back as zeros
    shards[2][:3] = torch.tensor([1e-6, -1e-5, 3e-4])[: min(numel, 3)]  # tiny beside the block
    payload, scales = zip(*(quantize(s, 256, how) for s in shards), strict=True)
    assert all(p.dtype == torch.uint8 and p.numel() == how.payload_bytes(numel) for p in payload)
    out = torch.empty(3 * numel, dtype=torch.bfloat16)
    dequantize_into(out, torch.cat(payload), torch.cat(scales), 3, 256, how)
    full = torch.cat(shards)
    for r in range(3):  # each rank's blocks by their own scales: none straddles two shards
        for b, scale in enumerate(scales[r]):
            block = slice(r * numel + b * 256, r * numel + min((b + 1) * 256, numel))
            got, want = out[block].float(), full[block]
            # the format's bound, and bf16's rounding of the result on top
            bound = _error_bound(wire, want, scale) + want.abs() * 2**-8
            assert ((got - want).abs() <= bound).all()
    assert not out[numel : numel + min(numel, 300)].any()


@pytest.mark.parametrize("wire", sorted(WIRE_FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_comes_back_non_finite_for_the_guard_to_see(wire, bad):
    """Its block's scale is non-finite, so the block comes back so: the non-finite check after
    the reduction still stops the step (a finite garbage value would train on)."""
    shard = torch.randn(300)
    shard[5] = bad
    payload, scales = quantize(shard, 256, wire_format(wire))
    out = torch.empty(300)
    dequantize_into(out, payload, scales, 1, 256, wire_format(wire))
    assert not torch.isfinite(out[:256]).any() and torch.isfinite(out[256:]).all()


def test_int4_packs_two_values_to_a_byte_low_nibble_first():
    how = wire_format("int4")
    payload, scales = quantize(torch.tensor([7.0, -7.0, 0.0]), 256, how)
    assert scales.tolist() == [1.0]
    assert payload.tolist() == [15 | 1 << 4, 8 | 8 << 4]  # (7+8, -7+8), (0+8, the pad's 8)


def test_quantized_weights_need_stage_3():
    with pytest.raises(PlanError, match="quantized_weights: int8 quantizes stage 3's all-gathers"):
        zerocc.load_plan({"zero": {"stage": 2, "quantized_weights": "int8"}})


def _plan(quantized: str, grads: str = "none", **sections) -> dict:
    return {
        "zero": {"stage": 3, "quantized_weights": quantized, "quantized_grads": grads},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-2, "eps": 1e-3},
        "backend": {"device": "cpu"},
        **sections,
    }


CASES = {
    "fp32": _plan("none"),
    "int8": _plan("int8"),
    "fp8": _plan("fp8"),
    "both-int8-inductor": _plan(
        "int8", "int8", backend={"device": "cpu", "name": "inductor-whole"}
    ),
    "bf16": _plan("none", precision={"param": "bf16"}),
    "bf16-int8": _plan("int8", precision={"param": "bf16"}),
    "grads-int8": _plan("none", "int8"),
    "grads-int4": _plan("none", "int4"),
    "both-int8": _plan("int8", "int8"),
    "bf16-grads-int8": _plan("none", "int8", precision={"param": "bf16"}),
}


def _train(rank: int, world: int) -> dict:
    out = {}
    for name, plan in CASES.items():
        torch.manual_seed(0)
        step = zerocc.compile(tiny_gpt(), plan)
        steps = STEPS if "inductor" not in name else 3
        batch = _gpt_batch(0, step.data_rank)  # one batch, learned
        losses = [float(step(*batch)) for _ in range(steps)]
        out[name] = {
            "losses": losses,
            "bytes": dict(step.comm.stats.bytes),  # of the last step
            "notes": step.record().backend_notes,
        }
    return out


@functools.cache
def _ranks() -> list[dict]:
    return run_ranks(2, _train)


@pytest.mark.parametrize(
    ("quantized", "plain", "ratio"),
    [("int8", "fp32", 4), ("fp8", "fp32", 4), ("bf16-int8", "bf16", 2)],
)
def test_8_bit_gathers_move_a_fraction_of_the_bytes_and_train_alike(quantized, plain, ratio):
    for rank in _ranks():
        q, p = rank[quantized], rank[plain]
        # 8-bit values, and one fp32 scale per 256 of them: 1/ratio of the bytes and ~1.6% more
        assert q["bytes"]["all_gather"] <= p["bytes"]["all_gather"] / ratio * 1.02
        assert q["bytes"]["all_gather"] > p["bytes"]["all_gather"] / ratio
        assert q["bytes"]["reduce_scatter"] == p["bytes"]["reduce_scatter"]  # (gradients as before)
        assert q["losses"][0] == pytest.approx(p["losses"][0], rel=FIRST_TOL)
        tail, plain_tail = sum(q["losses"][-5:]) / 5, sum(p["losses"][-5:]) / 5
        assert tail == pytest.approx(plain_tail, rel=CURVE_TOL)
        assert q["losses"] != p["losses"]  # (the gathers did round)
        assert q["losses"][-1] < q["losses"][0] - 2  # it learns the batch


def test_inductor_compiles_the_int8_collectives_into_the_whole_program():
    """Tolerance 1e-5, as tests/parity/test_inductor_parity.py's fp32 cases (Inductor reorders
    fp32 sums)."""
    for rank in _ranks():
        said = rank["both-int8-inductor"]["notes"]
        assert said[0].startswith("inductor: the whole program compiled"), said
        eager = rank["both-int8"]["losses"][:3]
        assert rank["both-int8-inductor"]["losses"] == pytest.approx(eager, rel=1e-5)


@pytest.mark.parametrize(
    ("quantized", "plain", "first_rounded", "bits"),  # first_rounded: the first loss a rounded
    [  # value reaches; bits: per value on the wire
        ("grads-int8", "fp32", 1, 8),
        ("grads-int4", "fp32", 1, 4),
        ("bf16-grads-int8", "bf16", 1, 8),
        ("both-int8", "fp32", 0, 8),
    ],
)
def test_quantized_gradient_exchanges_move_a_fraction_of_the_bytes_and_train_alike(
    quantized, plain, first_rounded, bits
):
    for rank in _ranks():
        q, p = rank[quantized], rank[plain]
        # what leaves a rank: the other rank's chunk (half the fp32 gradient, reduced in fp32
        # under bf16 too), in 8 or 4 bits a value, and a 4-byte scale per 256 of them
        sent = p["bytes"]["reduce_scatter"] / 2 / 4 * bits / 8
        assert "reduce_scatter" not in q["bytes"]
        # (the scales: 4 bytes per block of up to 256 values, some blocks short: 1.8% more
        # than int8's values here, 3.5% more than int4's)
        assert sent < q["bytes"]["all_to_all"] <= sent * (1 + 0.02 * 8 / bits)
        # (a bf16 loss is rounded to 2^-6 between 2 and 4: within two such steps, measured 2)
        first = {"abs": 2 * 2**-6, "rel": 0} if "bf16" in plain else {"rel": FIRST_TOL}
        i = first_rounded
        assert q["losses"][i] == pytest.approx(p["losses"][i], **first)
        tail, plain_tail = sum(q["losses"][-5:]) / 5, sum(p["losses"][-5:]) / 5
        assert tail == pytest.approx(plain_tail, rel=CURVE_TOL)
        assert q["losses"] != p["losses"]  # (the exchange did round)
        assert q["losses"][-1] < q["losses"][0] - 2  # it learns the batch


def test_quantized_grads_need_a_reduce_scatter():
    with pytest.raises(PlanError, match="stage 0 all-reduces its gradients"):
        zerocc.load_plan({"zero": {"stage": 0, "quantized_grads": "int8"}})
