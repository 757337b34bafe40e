"""Parity with a learning-rate schedule: N gloo ranks under `optimizer.schedule` match one
process training on all ranks' batches with torch.optim and torch.optim.lr_scheduler stepped
after every optimizer step, over enough steps to cross warmup and the decay (to its end: torch's
cosine is periodic beyond it, zerocc holds the end; tests/compiler/test_schedule.py checks that
part).

Tolerance 1e-5 relative, as tests/parity/test_parity.py and for its reasons (fp32; the sharded
run sums rank gradients once, the reference per chunk: a few ulps per step); 12 steps of AdamW
at these rates stay well inside it, and a rate one step off the schedule's moves the weights by
far more (checked: the constant-rate case of the same run is not within it).
"""

from __future__ import annotations

import functools

import pytest
from multirank import run_ranks

from parity import assert_matches_reference, case_id, relative_difference, train

TOL = 1e-5
ADAMW = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}
COSINE = {"name": "cosine", "warmup_steps": 3, "total_steps": 11}
CASES = [
    {
        "model": "gpt",
        "stage": 3,
        "world": 2,
        "steps": 12,
        "optimizer": {**ADAMW, "schedule": COSINE},
    },
    {
        "model": "buffers",
        "stage": 1,
        "world": 2,
        "steps": 12,
        "accum": 2,
        "optimizer": {
            **ADAMW,
            "grad_clip": 0.05,
            "schedule": {"name": "linear", "warmup_steps": 4, "total_steps": 10, "min_lr": 1e-3},
        },
    },
    {
        "model": "odd",
        "stage": 2,
        "world": 2,
        "steps": 8,
        "optimizer": {
            "name": "sgd",
            "lr": 0.1,
            "momentum": 0.9,
            "schedule": {"name": "constant", "warmup_steps": 5},
        },
    },
]
CONSTANT = {**CASES[0], "optimizer": ADAMW}


@functools.cache
def _results() -> list[dict]:
    return run_ranks(2, train, [*CASES, CONSTANT])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_scheduled_training_matches_torch(case):
    assert_matches_reference(_results(), case, TOL)


def test_the_schedule_changes_the_result():
    """The comparison can fail: training at the constant peak rate ends elsewhere."""
    scheduled = _results()[0][case_id(CASES[0])]["params"]
    constant = _results()[0][case_id(CONSTANT)]["params"]
    assert max(relative_difference(scheduled[k], constant[k]) for k in scheduled) > 100 * TOL
