"""Parity of the secondary partition (``zero.secondary_group``, ZeRO++'s hpZ): 4 gloo ranks at
stage 3, backward gathering each unit over groups of 2 from the copies forward kept, match one
process training on all four ranks' batches, step by step.

Tolerance 1e-5 relative in fp32, as tests/parity/test_parity.py and for its reasons (the same
sums as plain stage 3: the secondary copy holds exactly the values forward gathered, so
backward computes with the same weights). bf16 compute: 1e-2 against the reference recipe, as
test_mixed_precision_parity.py. A backward that gathered the wrong part (another rank's place
in its group, or the shard instead of the copy) would compute gradients with permuted weights,
off by far more than either.
"""

from __future__ import annotations

import functools

import pytest
from multirank import run_ranks

from parity import assert_matches_reference, case_id, train

TOL = 1e-5
TOL_BF16 = 1e-2
CASES = [
    {"model": "gpt", "stage": 3, "world": 4, "secondary": 2},
    {"model": "gpt", "stage": 3, "world": 4, "secondary": 2, "accum": 2,
     "recompute": {"units": "all"}},
    {"model": "gpt", "stage": 3, "world": 4, "secondary": 2, "precision": {"param": "bf16"}},
    {"model": "odd", "stage": 3, "world": 4, "secondary": 2,
     "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
]  # fmt: skip


@functools.cache
def _results() -> list[dict]:
    return run_ranks(4, train, CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_secondary_partition_matches_unsharded_training(case):
    assert_matches_reference(_results(), case, TOL_BF16 if "precision" in case else TOL)


def test_backward_gathers_inside_the_secondary_group():
    """Per step and rank: forward gathers Ψ elements over the 4-rank shard group, backward Ψ
    over the 2-rank secondary group (none over the shard group), and the reduce-scatter Ψ."""
    case = CASES[0]
    for rank in _results():
        result = rank[case_id(case)]
        elements, psi = dict(result["elements"]), result["psi"]
        assert elements.pop("all_gather (secondary)") == psi, result["elements"]
        assert elements.pop("all_gather") == psi
        assert elements.pop("reduce_scatter") == psi
        assert set(elements) <= {"all_reduce"}  # (the non-finite flags)
