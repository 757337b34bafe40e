"""Keyed draws on tensors split over tp (zerocc/compiler/parallel/split_draws.py): a draw of a
part (a rank's heads, hidden features, sequence chunk) is the whole tensor's draw, this rank's
chunk taken; a tensor every tp rank holds is drawn as it is. Parity of the example GPT with
dropout inside its split attention: tests/parity/test_tp_parity.py and
tests/parity/test_pipeline_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import GPT_TP_LAYERS, tiny_gpt_dropout
from multirank import run_ranks
from torch import nn

import zerocc
from zerocc.errors import CaptureError
from zerocc.ir.nodes import op_name
from zerocc.ir.rng import is_random

SEED = 11
# (eps 1e-3, as the parity tests: Adam's first steps divide by tiny square roots otherwise)
ADAMW = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}
LAYERS = {"up": "colwise", "down": "rowwise"}


def _plan(tp_layers: dict, draws: str = "keyed") -> dict:
    return {
        "zero": {"stage": 3},
        "optimizer": {"name": "adamw", **ADAMW},
        "parallel": {"tp": 2, "tp_layers": tp_layers},
        "capture": {"draws": draws},
        "seed": SEED,
        "backend": {"device": "cpu"},
    }


def _drawn(step: zerocc.TrainStep) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (op_name(n.target), tuple(n.meta["val"].shape))
        for n in step.program.graph.nodes
        if n.op == "call_function" and is_random(n)
    ]


def _gpt_program(draws: str) -> zerocc.TrainStep:
    torch.manual_seed(0)
    step = zerocc.compile(
        tiny_gpt_dropout(), {**_plan(GPT_TP_LAYERS, draws), "units": {"classes": ["Block"]}},
        comm=zerocc.FakeComm(2),
    )  # fmt: skip
    x = torch.randint(0, 32, (2, 8))
    step(x, x)
    return step


def test_attention_dropout_draws_every_head_and_keeps_the_rank_s():
    """The tiny GPT's 2 heads over tp 2: each rank holds 1 head's attention probabilities
    (2, 1, 8, 8); keyed, it draws both heads' (2, 2, 8, 8) and selects its own. The dropouts
    on whole tensors (embeddings, residuals: (2, 8, 16)) are drawn as they are."""
    attention, residual = ("aten.bernoulli_", (2, 2, 8, 8)), ("aten.bernoulli_", (2, 8, 16))
    assert _drawn(_gpt_program("keyed")) == [residual, attention, residual, residual,
                                             attention, residual, residual]  # fmt: skip
    selects = [n for n in _gpt_program("keyed").program.graph.nodes
               if n.target is torch.ops.aten.index_select.default and n.args[1] == 1]  # fmt: skip
    assert len(selects) == 2  # one per layer's attention, along the heads
    # under generator draws each rank draws its part's shape (alike on both: Megatron's way)
    assert ("aten.bernoulli_", (2, 1, 8, 8)) in _drawn(_gpt_program("generator"))


class NoisyMLP(nn.Module):
    """A split MLP whose hidden features (a part on each tp rank) go through ``native_dropout``
    and get ``rand_like`` noise: the two other ways a draw is taken apart."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = torch.native_dropout(torch.relu(self.up(x)), 0.25, True)
        h = h + 0.1 * torch.rand_like(h)
        return F.mse_loss(self.down(h), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _train_split_and_whole(rank: int, world: int) -> list[float]:
    """Largest relative difference, per step, between the tp-split run's loss and weights and
    one process drawing by key alike (every rank of the tp group trains the one batch)."""
    torch.manual_seed(0)
    step = zerocc.compile(NoisyMLP(), _plan(LAYERS))
    torch.manual_seed(0)
    model = NoisyMLP()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    worst = []
    for s in range(3):
        loss = float(step(*_batch(s)))
        with zerocc.keyed_draws(SEED, s, 0):
            expected = model(*_batch(s))
        worst_loss = abs(loss - float(expected.detach())) / abs(float(expected.detach()))
        expected.backward()
        opt.step()
        opt.zero_grad()
        mine = step.full_state_dict()
        worst.append(max(
            worst_loss,
            *(float((mine[k] - v).norm() / v.norm()) for k, v in model.state_dict().items()),
        ))  # fmt: skip
    return worst


def test_native_dropout_and_rand_like_on_split_features_match_one_process():
    """fp32: the split matmuls sum in another order (tests/parity/test_tp_parity.py's 1e-5);
    a mask that is not the whole draw's chunk differs by a dropped feature (1e-2 or more)."""
    for worst in run_ranks(2, _train_split_and_whole, timeout=300):
        assert max(worst) < 1e-5, worst


class SampledMLP(NoisyMLP):
    """Hidden features sampled by ``torch.bernoulli`` of their own values: a draw whose numbers
    depend on the split tensor's values, which no rank can take its part of."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.bernoulli(torch.sigmoid(self.up(x)))
        return F.mse_loss(self.down(h), y)


def test_a_draw_that_cannot_be_taken_apart_is_a_capture_error_naming_it():
    step = zerocc.compile(SampledMLP(), _plan(LAYERS), comm=zerocc.FakeComm(2))
    with pytest.raises(CaptureError, match=r"\(aten.bernoulli\) draws .* split over tp"):
        step(*_batch(0))
