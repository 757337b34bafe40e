"""Balanced pipeline stages (zerocc/cost/stage_balance.py): the split that evens out predicted
stage time, and what it says about it."""

from __future__ import annotations

import pytest
from models import GPT, GPTConfig, _gpt_batch
from staging import captured

from zerocc.cost.model import CostModel
from zerocc.cost.rates import DeviceRates
from zerocc.cost.stage_balance import _least_max_partition, balance_stages
from zerocc.errors import PlanError

COST = CostModel(DeviceRates.defaults("cpu"), 1)


def _split(vocab_size: int, n_layer: int = 8, stages: int = 4):
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=8, n_layer=n_layer, n_head=2,
                          n_embd=16))  # fmt: skip
    batch = _gpt_batch(0, 0)
    batch = tuple(b % vocab_size for b in batch)
    gm, _ = captured(model, batch)
    return balance_stages(gm, [f"transformer.h.{i}" for i in range(n_layer)], stages, COST)


def test_a_small_vocabulary_splits_the_blocks_evenly():
    split = _split(vocab_size=32)
    assert [len(units) for units in split.stage_units] == [2, 2, 2, 2]


def test_a_large_output_head_leaves_the_last_stage_fewer_blocks_and_says_why():
    split = _split(vocab_size=8192)
    sizes = [len(units) for units in split.stage_units]
    assert sum(sizes) == 8 and sizes[-1] < sizes[1]
    assert split.ends[1] > split.ends[0] > 0  # the head and loss outweigh the embeddings
    text = split.format()
    assert "head and loss" in text
    last = split.stage_units[-1]
    assert (
        f"stage 3: {last[0]}, predicted" if len(last) == 1 else f"stage 3: {len(last)} units"
    ) in text
    # The tied embedding is held by the first and the last stage.
    assert split.param_bytes[0] > split.param_bytes[1] < split.param_bytes[-1]


@pytest.mark.parametrize(
    ("weights", "parts", "expected"),
    [
        ([1, 1, 1, 1], 2, [[0, 1], [2, 3]]),
        ([5, 1, 1, 1, 1, 1], 2, [[0], [1, 2, 3, 4, 5]]),
        ([1, 2, 3, 4, 5], 3, [[0, 1, 2], [3], [4]]),
        ([3, 3], 2, [[0], [1]]),
    ],
)
def test_the_partition_minimises_the_largest_group(weights, parts, expected):
    assert _least_max_partition(weights, parts) == expected


def test_more_stages_than_units_is_a_plan_error():
    with pytest.raises(PlanError, match="5 stages need as many units or more, and the model has 4"):
        _split(vocab_size=32, n_layer=4, stages=5)
