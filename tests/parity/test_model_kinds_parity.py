"""Kinds of models zerocc once failed to compile (issue 15), on 2 gloo ranks at ZeRO 0-3: an
``nn.Sequential`` whose numbered children are units, ``nn.ModuleDict`` keys that are no Python
identifiers, recurrent layers (LSTM, 2-layer bidirectional LSTM, GRU, RNN tanh and relu), and
models that return their loss in a dict, a tuple or a namedtuple.

Each matches one process training on both ranks' batches, with the tolerance of test_parity
(1e-5 relative, fp32). The LSTM with dropout between its layers draws random masks, which the
one-process reference draws in another order: it is held to itself across stages instead (every
case starts from the same seed on each rank, so each stage draws the same masks).
All cases run in one spawn.
"""

from __future__ import annotations

import functools

import pytest
from models import MODEL_KINDS, RANDOM_KINDS
from multirank import run_ranks

from parity import assert_matches_reference, case_id, reference, relative_difference, train

TOL = 1e-5
STAGES = (0, 1, 2, 3)
CASES = [{"model": m, "stage": s, "world": 2} for m in MODEL_KINDS for s in STAGES]
RANDOM = [{"model": m, "stage": s, "world": 2} for m in RANDOM_KINDS for s in STAGES]


@functools.cache
def _results() -> list[dict]:
    return run_ranks(2, train, CASES + RANDOM)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_unsharded_training(case):
    ranks = _results()
    assert_matches_reference(ranks, case, TOL)


@pytest.mark.parametrize("case", [c for c in RANDOM if c["stage"]], ids=case_id)
def test_random_model_trains_at_every_stage_as_at_stage_zero(case):
    ours, stage0 = case_id(case), case_id({**case, "stage": 0})
    for rank, result in enumerate(_results()):
        losses, expected_losses = result[ours]["losses"], result[stage0]["losses"]
        for i, (a, b) in enumerate(zip(losses, expected_losses, strict=True)):
            assert abs(a - b) <= TOL * abs(b), f"rank {rank} micro-batch {i}: {a} vs {b}"
    params, expected = _results()[0][ours]["params"], _results()[0][stage0]["params"]
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert relative_difference(params[name], value) <= TOL, name


def test_the_dropout_lstm_draws_masks():
    """The comparison across stages means something only if the masks change the numbers: the
    dropout LSTM starts from lstm_deep's weights and reads its batches."""
    case = {"model": "lstm_dropout", "stage": 0, "world": 2}
    with_dropout = _results()[0][case_id(case)]["losses"]
    plain, _ = reference({**case, "model": "lstm_deep"})
    assert with_dropout[0] != plain[0][0]
    assert with_dropout[0] == pytest.approx(plain[0][0], rel=0.5)  # the same model otherwise
