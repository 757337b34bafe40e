"""Every rank starts from rank 0's weights and buffers (zerocc/compiler/state.py `allocate_state`),
as DDP broadcasts them: ranks seeded differently, a common mistake, must still train one model.

Parity against the reference built as rank 0 builds its model, at every stage; a model built on
``meta`` needs no broadcast (its initialization depends on the plan's seed and each tensor's name
alone), so ranks whose global RNG differs agree there too. Tolerance as tests/parity/test_parity.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from multirank import run_ranks
from torch import nn

import zerocc
from parity import assert_matches_reference, case_id, train

TOL = 1e-5  # as tests/parity/test_parity.py: float32 rounding of a few ulps per step, five steps

CASES = [{"model": "gpt", "stage": s, "world": 2, "rank_seeds": True} for s in range(4)]
CASES += [
    {"model": "buffers", "stage": 3, "world": 2, "rank_seeds": True},
    {"model": "gpt", "stage": 3, "world": 2, "rank_seeds": True, "meta": True},
]


@functools.cache
def _trained() -> list[dict]:
    return run_ranks(2, train, CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ranks_seeded_differently_train_rank_0s_model(case):
    assert_matches_reference(_trained(), case, TOL)


class _RandomBuffer(nn.Module):
    """Buffers drawn at random when the model is built (a fixed random projection), several of
    one shape: rank 0 broadcasts them in turn, and each rank must receive them in the order
    they were sent (a set's order, which follows each process's string hashes, once swapped
    two of them on rank 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        for name in ("noise", "alpha", "beta", "gamma", "delta", "epsilon"):
            self.register_buffer(name, torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * self.noise).pow(2).mean()


def _start(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + rank)  # each rank its own weights and buffer
    step = zerocc.compile(_RandomBuffer(), {"zero": {"stage": stage}, "backend": {"device": "cpu"}})
    return step.full_state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_and_weights_start_as_rank_0s(stage):
    states = run_ranks(2, _start, stage)
    torch.manual_seed(100)
    expected = _RandomBuffer().state_dict()
    for state in states:
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
