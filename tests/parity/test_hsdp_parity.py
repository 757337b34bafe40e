"""Parity of hybrid sharding (HSDP, ``zero.replicate``): 4 gloo ranks as 2 replicas of 2-rank
shard groups match one process training on all four ranks' batches, step by step (fp32).

Tolerance 1e-5 relative, as tests/parity/test_parity.py and for its reasons: the ranks' sum is
taken in two steps here (reduce-scatter within a shard group, all-reduce across replicas),
another association of the same float32 sum, a few ulps per step. A run that skipped the
all-reduce across replicas would train each replica on half the batches, a difference of 1e-2
or more after the first step. bf16 compute: 1e-2 against the reference recipe, as
test_mixed_precision_parity.py and for its reasons (a last-ulp difference in an fp32 sum can
flip a bf16 weight copy's rounding).
"""

from __future__ import annotations

import functools

import pytest
from multirank import run_ranks

from parity import assert_matches_reference, case_id, train

TOL = 1e-5
TOL_BF16 = 1e-2
CLIPPED = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "grad_clip": 0.05}
CASES = [
    {"model": "gpt", "stage": 3, "world": 4, "replicate": 2},
    {"model": "gpt", "stage": 2, "world": 4, "replicate": 2, "accum": 2, "optimizer": CLIPPED},
    {"model": "gpt", "stage": 1, "world": 4, "replicate": 2, "accum": 2},
    # small units' reduce-scatters bucketed: each unit's all-reduce across replicas follows
    {
        "model": "gpt",
        "stage": 2,
        "world": 4,
        "replicate": 2,
        "accum": 2,
        "overlap": {"bucket_mb": 64},
    },
    {"model": "gpt", "stage": 3, "world": 4, "replicate": 2, "overlap": {"bucket_mb": 64}},
    {"model": "gpt", "stage": 3, "world": 4, "replicate": 2, "precision": {"param": "bf16"}},
    {
        "model": "odd",
        "stage": 3,
        "world": 4,
        "replicate": 2,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    },
]


@functools.cache
def _results() -> list[dict]:
    return run_ranks(4, train, CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hybrid_sharding_matches_unsharded_training(case):
    assert_matches_reference(_results(), case, TOL_BF16 if "precision" in case else TOL)


def test_shards_move_within_their_group_and_gradients_across_replicas():
    """Per step and rank: the all-gathers and reduce-scatters move Ψ elements each over the
    2-rank shard group (3Ψ at stage 3 with backward's gathers), and the all-reduce across
    replicas the rank's gradient shard, Ψ/2, counted twice as an all-reduce is."""
    case = CASES[0]
    result = _results()[0][case_id(case)]
    elements, psi = dict(result["elements"]), result["psi"]
    assert elements.pop("all_reduce (replicate)") == 2 * psi // 2, result["elements"]
    assert elements.pop("all_reduce") == 2 * 3  # one non-finite flag per unit, in its group
    assert elements == {"all_gather": 2 * psi, "reduce_scatter": psi}
