"""The benchmark's configuration, and the model and batches every system trains on (the
example GPT by default; ``--model mixtral``: transformers' Mixtral, a mixture of experts).

Each rank of each system builds the model from the same seed, so every system starts from the
same weights, and draws its batches from examples/gpt/data.py, so
rank r of every system sees the same data at every step.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

import data  # noqa: E402  (examples/gpt/data.py)
from model import GPT, GPTConfig  # noqa: E402  (examples/gpt/model.py)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: the model, the data, the optimizer, the ranks and the schedule."""

    n_layer: int = 10  # transformer blocks
    n_embd: int = 512  # residual width (n_layer 10 × n_embd 512: 31.6M parameters)
    n_head: int = 8  # attention heads
    block_size: int = 64  # tokens per sequence
    vocab_size: int | None = None  # None: the text's characters (65); pad for LLM-like heads
    batch_size: int = 8  # sequences per rank and step
    seed: int = 0  # weights and data
    lr: float = 1e-3  # AdamW, the same for every system; no gradient clipping anywhere
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.1
    world_size: int = 2  # ranks per system
    device: str = "cpu"  # cpu (gloo) | cuda (NCCL, one GPU per rank)
    dtype: str = "fp32"  # compute dtype: fp32 | bf16 (fp32 master weights and optimizer)
    threads: int = 1  # torch threads per rank: the machine's cores shared equally by the ranks
    warmup: int = 2  # untimed steps per system first (capture, torch.compile, allocator)
    rounds: int = 5  # timed rounds; every system runs 1 + `steps` steps per round, in turn
    steps: int = 3  # timed steps per system and round (after one untimed step)
    sequential: bool = False  # each system's rounds before the next is set up (not interleaved)
    nvme_path: str | None = None  # folder for the files of NVMe offload (None: the temp folder)
    model: str = "gpt"  # gpt (examples/gpt) | mixtral (transformers' Mixtral: experts below)
    experts: int = 8  # mixtral: experts per layer, each token routed to 2
    experts_implementation: str = "eager"  # mixtral: transformers' eager | grouped_mm

    @property
    def total_steps(self) -> int:
        """Optimizer steps every system takes: the loss after these is compared (the warm-up,
        one step whose allocations are measured, the rounds)."""
        return self.warmup + 1 + self.rounds * (1 + self.steps)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes over all ranks."""
        return self.world_size * self.batch_size * self.block_size


# compare.py --gpu (and profile_step.py --gpu): one GPU, bf16 compute, NCCL, a GPT-2-medium-sized
# model (354M parameters) on 16 sequences of 1024 tokens per step
GPU = dict(n_layer=24, n_embd=1024, n_head=16, block_size=1024, vocab_size=50304, batch_size=16,
           world_size=1, device="cuda", dtype="bf16", warmup=3, rounds=5, steps=5)  # fmt: skip


def gpt_config(cfg: BenchConfig) -> GPTConfig:
    return GPTConfig(
        vocab_size=cfg.vocab_size or data.vocab_size,
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
    )


class MixtralLM(nn.Module):
    """transformers' Mixtral at the benchmark's sizes (``n_embd`` wide, ``n_layer`` decoder
    layers, ``cfg.experts`` experts of width 2 × ``n_embd``, top-2), trained as the GPT is:
    ``forward(idx, targets)`` is the mean cross-entropy of ``targets``, plus the router's
    load-balancing loss (coefficient 0.02)."""

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=cfg.vocab_size or data.vocab_size, hidden_size=cfg.n_embd,
            intermediate_size=2 * cfg.n_embd, num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
            num_local_experts=cfg.experts, num_experts_per_tok=2,
            max_position_embeddings=cfg.block_size, output_router_logits=True,
            router_aux_loss_coef=0.02, experts_implementation=cfg.experts_implementation,
        )  # fmt: skip
        self.lm = MixtralForCausalLM(config)
        self.aux_coef = config.router_aux_loss_coef

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=idx)
        logits = out.logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + self.aux_coef * out.aux_loss


def build_model(cfg: BenchConfig) -> nn.Module:
    """The benchmark's model in fp32 on the CPU, with the weights of seed ``cfg.seed``: the
    example GPT, or (``cfg.model: mixtral``) :class:`MixtralLM`."""
    torch.manual_seed(cfg.seed)
    return MixtralLM(cfg) if cfg.model == "mixtral" else GPT(gpt_config(cfg))


def layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: FSDP2's units, and zerocc's (:func:`layer_class`)."""
    return list(model.lm.model.layers if isinstance(model, MixtralLM) else model.transformer.h)


def layer_class(cfg: BenchConfig) -> str:
    """The class name of the model's repeated layers (zerocc's ``units.classes``)."""
    return "MixtralDecoderLayer" if cfg.model == "mixtral" else "Block"


def model_name(cfg: BenchConfig) -> str:
    """How titles name the model: ``GPT 31.6M``, ``Mixtral 8×top-2 12.3M``."""
    millions = f"{num_params(cfg) / 1e6:.1f}M"
    if cfg.model == "mixtral":
        return f"Mixtral {cfg.experts}×top-2 {millions}"
    return f"GPT {millions}"


def num_params(cfg: BenchConfig) -> int:
    """Parameters of the model (the tied embedding once), computed without building it (the
    Mixtral: built on the meta device)."""
    if cfg.model == "mixtral":
        with torch.device("meta"):
            return sum(p.numel() for p in MixtralLM(cfg).parameters())
    c = gpt_config(cfg)
    per_block = 12 * c.n_embd**2 + 13 * c.n_embd  # attention 4C² + 4C, MLP 8C² + 5C, 2 LNs 4C
    return c.vocab_size * c.n_embd + c.block_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd


def active_params(cfg: BenchConfig) -> int:
    """Parameters one token passes through: all, but of each layer's experts only its 2."""
    if cfg.model != "mixtral":
        return num_params(cfg)
    per_expert = 3 * cfg.n_embd * 2 * cfg.n_embd  # gate, up and down projections
    return num_params(cfg) - cfg.n_layer * (cfg.experts - 2) * per_expert


def flops_per_token(cfg: BenchConfig) -> int:
    """Training FLOPs per token, as PaLM's MFU counts them: 6N (N: the parameters a token passes
    through) plus attention's 12·L·T·C."""
    return 6 * active_params(cfg) + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


def batches(cfg: BenchConfig, rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s (idx, targets) batches, each (batch_size, block_size)."""
    return data.batches(
        rank, cfg.world_size, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=cfg.seed
    )


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line flags every benchmark takes for the model and the schedule; each one
    given overrides that field of the config (see :func:`config_from`)."""
    p.add_argument("--model", choices=["gpt", "mixtral"], help="the model (default gpt)")
    p.add_argument("--experts", type=int, help="mixtral: experts per layer (top-2 routing)")
    p.add_argument("--experts-implementation", choices=["eager", "grouped_mm"],
                   help="mixtral: transformers' experts implementation")  # fmt: skip
    p.add_argument("--layers", type=int, dest="n_layer")
    p.add_argument("--embd", type=int, dest="n_embd")
    p.add_argument("--heads", type=int, dest="n_head")
    p.add_argument("--block", type=int, dest="block_size")
    p.add_argument("--batch", type=int, dest="batch_size", help="sequences per rank and step")
    p.add_argument("--warmup", type=int, help="untimed steps per system")
    p.add_argument("--rounds", type=int, help="timed rounds")
    p.add_argument("--steps", type=int, help="timed steps per system and round")
    p.add_argument(
        "--sequential",
        action="store_true",
        default=None,
        help="time each system's rounds, and close it, before setting up the next (one "
        "system's memory at a time; no interleaving against a machine's drift)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds a system may take to set up, or to answer one command",
    )


def config_from(args: argparse.Namespace, base: BenchConfig) -> BenchConfig:
    """``base`` with every config field the flags gave, and each rank's share of the cores."""
    given = {k: v for k, v in vars(args).items() if k in BenchConfig.__dataclass_fields__}
    cfg = replace(base, **{k: v for k, v in given.items() if v is not None})
    return replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.world_size))
