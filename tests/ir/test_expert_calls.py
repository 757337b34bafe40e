"""The experts calls a capture registers live as long as their experts module: a dropped
step's model takes its calls with it (plan auto compiles a step per candidate)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from zerocc.ir import expert_calls


def _scaled(module: nn.Module, rows: torch.Tensor, got: torch.Tensor, state) -> torch.Tensor:
    return module(rows) * got.sum()


def test_a_call_is_known_while_its_module_lives_and_gone_with_it():
    module = nn.Linear(2, 2)
    expert_calls.register("experts#test", module, _scaled)
    rows, got = torch.ones(3, 2), torch.tensor([1, 2])
    assert torch.equal(expert_calls.experts_forward("experts#test", rows, got, []),
                       _scaled(module, rows, got, []).detach())  # fmt: skip
    del module
    gc.collect()
    with pytest.raises(RuntimeError, match="the model of its step is gone"):
        expert_calls.experts_forward("experts#test", rows, got, [])
    assert "experts#test" not in expert_calls._CALLS
