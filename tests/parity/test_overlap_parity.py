"""The overlap pass on gloo ranks: every stage gives bit-identical losses and weights with
overlap on (prefetch, late waits, buckets, units kept gathered) and off.

Exact equality, no tolerance: the pass moves only collective starts, waits and the in-place
accumulation of reduced gradients, never compute relative to compute, and a bucket reduces each
element over the same two ranks (a sum of two floats does not depend on its order).
"""

from __future__ import annotations

import functools

import pytest
from multirank import run_ranks

from parity import assert_bit_identical, case_id, train

OFF = {"enabled": False}
BUCKETS = {"bucket_mb": 1, "prefetch": 2}
CLIPPED = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "grad_clip": 0.05}

VARIANTS = [
    *({"model": "gpt", "stage": s} for s in range(4)),
    {"model": "gpt", "stage": 3, "overlap": BUCKETS, "accum": 2, "optimizer": CLIPPED},
    {"model": "gpt", "stage": 3, "units": {"keep_gathered": ["root"]}, "overlap": BUCKETS},
    {"model": "gpt", "stage": 3, "overlap": {"max_inflight_mb": 0.05}},
    {"model": "gpt", "stage": 2, "overlap": BUCKETS, "precision": {"param": "bf16"}},
    {"model": "gpt", "stage": 1, "accum": 2, "optimizer": CLIPPED, "overlap": BUCKETS},
    {"model": "gpt", "stage": 0, "overlap": BUCKETS},
    {"model": "odd", "stage": 3, "overlap": BUCKETS},
]


def _pair(variant: dict) -> tuple[dict, dict]:
    on = {"world": 2, "steps": 3, **variant}
    off = {**on, "overlap": OFF, "units": {}}
    return on, off


@functools.cache
def _results() -> list[dict]:
    cases = [case for variant in VARIANTS for case in _pair(variant)]
    return run_ranks(2, train, cases)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: case_id({"world": 2, **v}))
def test_overlap_keeps_losses_and_weights_bit_identical(variant):
    assert_bit_identical(_results(), *_pair(variant))
