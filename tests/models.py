"""Small models for what sharding gets wrong: ties, frozen parts, reuse, buffers, unused
parameters, odd sizes.

Each entry of ``MODELS`` builds a model deterministically and makes rank-local batches, so a
worker process and the reference in the test process build the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from model import GPT, GPTConfig
from torch import nn


class FrozenBackbone(nn.Module):
    """A frozen feature extractor under a trainable head (the LoRA/PEFT shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16))
        self.backbone.requires_grad_(False)
        self.adapter = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        h = h + self.adapter(h)
        return F.cross_entropy(self.head(h), y)


class CalledTwice(nn.Module):
    """One block applied twice, with another block in between."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(10, 10), nn.GELU())
        self.middle = nn.Sequential(nn.Linear(10, 10), nn.Tanh())
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.shared(self.middle(self.shared(x)))
        return F.cross_entropy(self.out(x), y)


class WithBuffers(nn.Module):
    """A persistent buffer (a fixed scale) and a non-persistent one (a mask) in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("mask", (torch.arange(8) % 3 != 0).float(), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin1(x)) * self.scale * self.mask
        return F.mse_loss(self.lin2(h), y)


class OddSizes(nn.Module):
    """Parameter sizes that no world size above one divides (7×5, 5, 13×7, 13, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 13)
        self.c = nn.Linear(13, 1)
        self.gain = nn.Parameter(torch.tensor([1.0, 0.5, 2.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))  # (B, 1)
        return F.mse_loss(h * self.gain.sum(), y)


class UnusedInUnit(nn.Module):
    """A parameter the loss never reaches (an unused pooler) in a unit with ones it does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 9), nn.Tanh())
        self.pooler = nn.Linear(9, 9)  # never called: torch.optim skips it, so must zerocc
        self.head = nn.Linear(9, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(x)), y)


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))


def tiny_gpt_dropout() -> GPT:
    """The tiny GPT with dropout after the embeddings, in attention and on both residuals."""
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1))


def _gpt_batch(step: int, rank: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (batch, 8), generator=g)
    return x, torch.randint(0, 32, (batch, 8), generator=g)


def _features(n_in: int, target: Callable[[torch.Generator, int], torch.Tensor]):
    def batch(step: int, rank: int, size: int = 4):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(size, n_in, generator=g), target(g, size)

    return batch


# name -> (build, batch(step, rank), units section)
MODELS = {
    "gpt": (tiny_gpt, _gpt_batch, {"classes": ["Block"]}),
    "frozen": (
        FrozenBackbone,
        _features(12, lambda g, n: torch.randint(0, 5, (n,), generator=g)),
        {"modules": ["backbone", "adapter"]},
    ),
    "twice": (
        CalledTwice,
        _features(10, lambda g, n: torch.randint(0, 3, (n,), generator=g)),
        {"modules": ["shared", "middle"]},
    ),
    "buffers": (
        WithBuffers,
        _features(8, lambda g, n: torch.randn(n, 4, generator=g)),
        {"modules": ["lin1"]},
    ),
    "unused": (
        UnusedInUnit,
        _features(6, lambda g, n: torch.randint(0, 2, (n,), generator=g)),
        {"modules": ["body"]},
    ),
    "odd": (
        OddSizes,
        _features(5, lambda g, n: torch.randn(n, 1, generator=g)),
        {"modules": ["a", "b"]},
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


# Models whose forward draws random numbers, as MODELS entries. Not in MODELS: the parity matrix
# holds every entry of it against one process training on all ranks' batches, which draws other
# numbers; a run of one of these is compared with another run of itself (recompute on and off).
RANDOM_MODELS = {"gpt_dropout": (tiny_gpt_dropout, _gpt_batch, {"classes": ["Block"]})}
