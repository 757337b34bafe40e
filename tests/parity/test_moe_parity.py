"""Mixture-of-experts models on 2 gloo ranks against one process (issue 48): transformers'
Mixtral, Qwen2-MoE (a shared expert beside the routed ones) and DeepSeek-V3 (8 small experts,
top-2 of 2 groups out of 4, a dense first layer), each with the three experts implementations
the library runs on the CPU: ``eager`` (each expert's tokens found with ``nonzero``, a Python
loop over the experts hit: captured as opaque regions), ``grouped_mm`` (tokens sorted by
expert, one ``torch._grouped_mm``: captured whole) and ``batched_mm`` (each token's experts'
weights gathered, one batched matmul: captured whole). Mixtral and Qwen2-MoE add the router's
load-balancing loss (coefficient 0.1), so its gradient reaches the router.

fp32 to 1e-5 relative, the tolerance of the other fp32 parity tests (the ranks sum gradients in
another order: ulps per step); bf16 to 1e-2 against the same recipe, as
test_mixed_precision_parity justifies. Mixtral runs at every stage with eager and grouped_mm
experts, with its experts as units of their own, and in bf16; the other cases at stage 3,
their stages 0-2 with ``--slow`` (the same capture, the passes those stages share with
Mixtral's).
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip(
    "transformers", reason='mixture-of-experts models need transformers: pip install "zerocc[hf]"'
)

from multirank import run_ranks  # noqa: E402

from parity import assert_matches_reference, case_id, train  # noqa: E402

TOL = 1e-5
KINDS = ("mixtral", "qwen_moe", "deepseek")
IMPLS = ("", "_grouped", "_batched")  # eager, grouped_mm, batched_mm experts
EVERY_STAGE = ("mixtral", "mixtral_grouped")
BF16_TOL = 1e-2
MODELS = [f"{kind}{impl}" for kind in KINDS for impl in IMPLS]
CASES = [
    {"model": m, "stage": s, "world": 2}
    for m in MODELS
    for s in range(4)
    if m in EVERY_STAGE or s == 3
]
CASES += [
    # Each layer's experts a unit of its own: gathered only around the experts' op.
    {"model": "mixtral", "stage": 3, "world": 2,
     "units": {"classes": ["MixtralDecoderLayer", "MixtralExperts"]}},
]  # fmt: skip
BF16 = [
    {"model": m, "stage": 3, "world": 2, "precision": {"param": "bf16"}}
    for m in ("mixtral", "mixtral_grouped")
]
SLOW = [
    {"model": m, "stage": s, "world": 2} for m in MODELS for s in range(3) if m not in EVERY_STAGE
]


@functools.cache
def _results(slow: bool) -> list[dict]:
    return run_ranks(2, train, SLOW if slow else CASES + BF16)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_unsharded_training(case):
    assert_matches_reference(_results(False), case, TOL)


@pytest.mark.parametrize("case", BF16, ids=case_id)
def test_bf16_matches_the_cast_recipe(case):
    assert_matches_reference(_results(False), case, BF16_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=case_id)
def test_other_stages_match_unsharded_training(case):
    assert_matches_reference(_results(True), case, TOL)
