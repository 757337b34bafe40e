"""The sweep's oracle for float8 rows (tests/sweep/feature_rows.py): one process training the
converted model, its gradients summed as the row's ranks sum them.

The GPT of 4 blocks with float8 matmuls on 2 data ranks of 2 micro-batches each, ZeRO stage 0:
each rank accumulates its micro-batches, then the ranks' sums are added. The harness's
reference adds micro-batch by micro-batch over the ranks: the same sum in another
association, a few ulps apart after the first step, which the second step's float8 casts
magnify to 3e-2 in its gradients and 5.65e-4 in the tied embedding. That was the sweep's row
``stage=0,model=gpt,pp=zero-bubble,fp8=matmul,in_memory=on`` (issue 77), whose pipeline trains
as this step does with every schedule: held to the harness's order it failed its 1e-5 bound
by 5.65e-4; held to its ranks' order it lies within 2e-7.
"""

from __future__ import annotations

from typing import Any

import parity
import pytest
from feature_rows import _converted, _summed_as_the_ranks_sum, assert_row_trained_alike, run_row
from parity import relative_difference

CASE: dict[str, Any] = {
    "id": "float8-accumulated-on-2-ranks",
    "model": "gpt4",
    "stage": 0,
    "world": 2,
    "accum": 2,
    "steps": 2,
    "fields": {"precision.matmul": "fp8"},
}
# The sweep's row as it failed: a zero-bubble pipeline of 2 ranks, each stage on 2 data ranks
# (its checkpoint.in_memory acts under zerocc train alone). The covering array has no row of
# it: its pairs are all in others, zero-bubble with fp8 in a row with recompute and bf16.
PIPELINE = CASE | {"id": "float8-zero-bubble-pp2-dp2", "world": 4, "pp": 2,
                   "schedule": "zero-bubble"}  # fmt: skip


@pytest.mark.parametrize(
    "case", [CASE, pytest.param(PIPELINE, marks=pytest.mark.slow)], ids=lambda c: c["id"]
)
def test_a_float8_step_trains_as_one_process_summing_as_its_ranks_do(case):
    """Failed before (the harness's order): transformer.wte.weight 5.65e-04 (bound 1e-05)."""
    assert_row_trained_alike(run_row(case), case)


def test_the_two_orders_of_the_sum_train_float8_apart():
    """The case above tells the orders apart: were the float8 steps blind to the last bits of
    a gradient's sum, the test above would hold nothing."""
    with _converted(CASE):
        _, harness = parity.reference(CASE)
        with _summed_as_the_ranks_sum(CASE):
            _, ranks_order = parity.reference(CASE)
    name = "transformer.wte.weight"
    assert relative_difference(harness[name], ranks_order[name]) > 1e-4
