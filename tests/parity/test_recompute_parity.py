"""The recompute pass on gloo ranks: checkpointed runs match unsharded training, and give the
losses and weights of the same run without recompute, bit for bit, dropout included.

Parity tolerances are those of test_parity (fp32, 1e-5 relative) and test_mixed_precision
(bf16, 1e-2): recompute adds no arithmetic of its own. On vs off is exact: the copies run the
same ops on the same inputs, and the RNG replay makes every dropout mask of a copy the one its
forward drew, and every later draw what it would have been without the copies.
"""

from __future__ import annotations

import functools

import pytest
from models import MODELS, RANDOM_MODELS
from multirank import run_ranks

from parity import assert_bit_identical, assert_matches_reference, case_id, reference, train

ALL = {"units": "all"}
LAST_BLOCK = {"units": ["transformer.h.1"]}
BF16 = {"param": "bf16"}

# Against the one-process reference: (case, tolerance).
REFERENCE = [
    *(({"model": "gpt", "stage": s, "recompute": ALL}, 1e-5) for s in range(4)),
    ({"model": "gpt", "stage": 3, "recompute": LAST_BLOCK}, 1e-5),
    ({"model": "twice", "stage": 3, "recompute": ALL}, 1e-5),  # a unit called twice
    ({"model": "gpt", "stage": 3, "precision": BF16, "recompute": ALL}, 1e-2),
    # one unit of both blocks (units.blocks_per_unit): each block's calls recomputed alike
    ({"model": "gpt", "stage": 3, "units": {"blocks_per_unit": 2}, "recompute": ALL}, 1e-5),
]
# Units of two blocks against units of one, exactly: the same sums (2 ranks), in larger flats.
GROUPED = [{"model": "gpt", "stage": s, "units": {"blocks_per_unit": 2}} for s in (1, 3)]
# Against the same run without recompute, exactly.
ON_OFF = [
    {"model": "gpt_dropout", "stage": 0, "recompute": ALL},
    {"model": "gpt_dropout", "stage": 3, "recompute": ALL},
    {"model": "gpt_dropout", "stage": 2, "recompute": LAST_BLOCK, "precision": BF16},
]


def _full(case: dict) -> dict:
    return {"world": 2, "steps": 3, **case}


def _off(case: dict) -> dict:
    return {k: v for k, v in _full(case).items() if k != "recompute"}


def _train(rank: int, world: int, cases: list[dict]) -> dict:
    """parity.train, knowing the models that draw random numbers (in this rank's process)."""
    MODELS.update(RANDOM_MODELS)
    return train(rank, world, cases)


@functools.cache
def _results() -> list[dict]:
    cases = [_full(c) for c, _ in REFERENCE]
    cases += [c for case in ON_OFF for c in (_full(case), _off(case)) if c not in cases]
    cases += [c for case in GROUPED for c in (_full(case), _ungrouped(case)) if c not in cases]
    return run_ranks(2, _train, cases)


def _ungrouped(case: dict) -> dict:
    return {k: v for k, v in _full(case).items() if k != "units"}


@pytest.mark.parametrize("case,tol", REFERENCE, ids=[case_id(_full(c)) for c, _ in REFERENCE])
def test_checkpointed_training_matches_unsharded_training(case, tol):
    assert_matches_reference(_results(), _full(case), tol)


@pytest.mark.parametrize("case", ON_OFF, ids=[case_id(_full(c)) for c in ON_OFF])
def test_recompute_is_bit_identical_to_saving_activations(case):
    assert_bit_identical(_results(), _full(case), _off(case))


@pytest.mark.parametrize("case", GROUPED, ids=[case_id(_full(c)) for c in GROUPED])
def test_units_of_two_blocks_train_as_units_of_one(case):
    assert_bit_identical(_results(), _full(case), _ungrouped(case))


def test_the_dropout_model_draws_masks():
    """The exact comparison with dropout means something only if the masks change the numbers:
    the dropout GPT starts from the plain GPT's weights and reads its batches."""
    with_dropout = _results()[0][case_id(_off(ON_OFF[0]))]["losses"]
    plain, _ = reference({**_off(ON_OFF[0]), "model": "gpt"})
    assert with_dropout[0] != plain[0][0]
    assert with_dropout[0] == pytest.approx(plain[0][0], rel=0.1)  # the same model otherwise
