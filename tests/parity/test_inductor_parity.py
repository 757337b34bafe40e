"""The Inductor backend on gloo ranks: each stage trains as one process training on all
ranks' batches does, and as the eager backend does, compiled as one graph.

Tolerance, fp32: 1e-5 relative, the fp32 parity tests' (test_parity.py), against both the
reference and the eager backend. Inductor fuses elementwise ops and reorders reductions (layer
norm statistics, softmax sums, the loss's mean), a few ulps per op, ~1e-7 relative after three
steps of the GPT; a wrong kernel, a lost in-place update or a gradient read before its
reduction moves the loss by far more. bf16 compute: 1e-2, as test_mixed_precision.py, the
reference computing in bf16 too, on the losses and on each weight matrix. Inductor rounds
differently inside its fused kernels (a bf16 ulp is 4e-3), and a vector parameter's gradient
(a bias, a norm's) is a sum over every token of bf16 terms that cancel: its relative rounding
is not bounded by the ulp (1.3e-2 measured on a layer norm's bias). Vector parameters are
compared with the rest, as one vector of all the model's weights, at 1e-3 (2.3e-4 measured).
The bf16 case trains with SGD: AdamW divides each element's update by its gradient's own
magnitude, so a near-zero gradient element whose sign the rounding flips moves its weight by
±lr, whatever the tolerance on the rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch
from multirank import run_ranks

from parity import assert_matches_reference, case_id, reference, relative_difference, train

FP32 = [
    {"model": "gpt", "stage": 1},
    {"model": "gpt", "stage": 2, "accum": 2},
    {"model": "gpt", "stage": 3},
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu"}},  # the update on the host
    # Its gradients kept on the device, copied through the program's two host buffers.
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu", "grads": "device"}},
    # Host updates carried into the next step, issued to the host's worker from the graph.
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu", "pipeline": "next_forward"}},
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu", "pipeline": "delayed"}},
    # Stage 2: the carried copy writes this rank's view of the whole weights, all-gathered in
    # the graph before forward reads them.
    {"model": "gpt", "stage": 2, "offload": {"optimizer": "cpu", "pipeline": "next_forward"}},
    # Dropout, recomputed, in the whole graph: the masks of ATen's generator, replayed for the
    # recomputation. Held to the eager backend only: the one-process reference draws its masks
    # in another order.
    {"model": "gpt_dropout", "stage": 3, "checkpointing": {"units": "all"}},
]
_BF16 = {
    "model": "gpt",
    "stage": 3,
    "precision": {"param": "bf16"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
}
# The second: updates on the host writing the bf16 copy into the program's host buffers.
BF16 = [_BF16, {**_BF16, "offload": {"optimizer": "cpu"}}]


def _pair(case: dict) -> tuple[dict, dict]:
    ours = {"world": 2, "steps": 3, "backend": "inductor", **case}
    return ours, {**ours, "backend": "eager"}


@functools.cache
def _results() -> list[dict]:
    return run_ranks(2, train, [c for case in [*FP32, *BF16] for c in _pair(case)])


def _assert_losses_close(ours: dict, theirs: list[list[float]], tol: float) -> None:
    """Every rank's losses of case ``ours`` within ``tol`` of ``theirs`` (per rank)."""
    for rank, result in enumerate(_results()):
        for i, (a, b) in enumerate(zip(result[case_id(ours)]["losses"], theirs[rank], strict=True)):
            assert abs(a - b) <= tol * abs(b), f"rank {rank} micro-batch {i}: {a} vs {b}"


@pytest.mark.parametrize("case", FP32, ids=lambda c: case_id({"world": 2, **c}))
def test_fp32_matches_the_eager_backend_and_the_reference(case):
    ours, eager = _pair(case)
    _assert_losses_close(ours, [r[case_id(eager)]["losses"] for r in _results()], 1e-5)
    params, eager_params = (_results()[0][case_id(c)]["params"] for c in (ours, eager))
    for name, value in eager_params.items():
        assert relative_difference(params[name], value) <= 1e-5, name
    if case["model"] != "gpt_dropout":
        assert_matches_reference(_results(), ours, 1e-5)


@pytest.mark.parametrize("case", [*FP32, *BF16], ids=lambda c: case_id({"world": 2, **c}))
def test_each_program_is_compiled_whole(case):
    """Every program compiled as one graph, the dropout GPT's included (its random ops chained
    in the program's order)."""
    for result in _results():
        notes = result[case_id(_pair(case)[0])]["backend_notes"]
        assert notes[0].startswith("inductor: the whole program compiled as one"), notes


@pytest.mark.parametrize("case", BF16, ids=lambda c: case_id({"world": 2, **c}))
def test_bf16_matches_the_reference_within_its_rounding(case):
    ours, _ = _pair(case)
    ref_losses, ref_state = reference(ours)
    _assert_losses_close(ours, ref_losses, 1e-2)
    params = _results()[0][case_id(ours)]["params"]
    for name, value in ref_state.items():
        if value.dim() >= 2:
            assert relative_difference(params[name], value) <= 1e-2, name
    names = sorted(ref_state)
    whole, ref_whole = (
        torch.cat([s[n].double().flatten() for n in names]) for s in (params, ref_state)
    )
    assert relative_difference(whole, ref_whole) <= 1e-3
