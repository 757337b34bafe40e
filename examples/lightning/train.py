"""A Lightning script on zerocc: the script users already have, with
``strategy=ZeroccStrategy("zero3.yaml")`` where ``strategy="deepspeed_stage_3"`` (or
``"fsdp"``) was; docs/integrations.md shows the one-line change.

A small byte-level GPT (two transformer blocks) learns to continue text (by default this
file's own source), AdamW with a linear warmup and decay stepped per step, gradients clipped
at 1.0, a validation loop and a checkpoint every ``--save-every`` steps. Launch as usual,
Lightning's launcher starting the ranks:

    python examples/lightning/train.py --devices 2 --max-steps 20 --out run/

(or ``torchrun --nproc_per_node 2 examples/lightning/train.py ...``). ``--plan`` takes a plan
YAML or the DeepSpeed JSON the script was run with.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerocc.integrations.lightning import ZeroccStrategy

HERE = Path(__file__).parent


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: one FSDP unit of the plan."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # (qkv has no bias: the keys' would get no gradient, softmax ignores a shift)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, C/heads)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class TinyGPT(pl.LightningModule):
    """A byte-level GPT; ``training_step`` returns (and logs) the next-byte loss."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, seq_len: int = 32,
                 lr: float = 3e-3, warmup: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, dim)  # (B, T) -> (B, T, C)
        self.position = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, 256)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch[0])
        self.log("train_loss", loss, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch[0]), sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        total, warmup = self.trainer.estimated_stepping_batches, self.hparams.warmup

        def warmup_then_decay(step: int) -> float:  # get_linear_schedule_with_warmup's
            if step < warmup:
                return step / max(1, warmup)
            return max(0.0, (total - step) / max(1, total - warmup))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def text_rows(path: Path, seq_len: int) -> TensorDataset:
    """The file's bytes cut into rows of ``seq_len + 1`` (inputs and their next bytes)."""
    data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    rows = data[: len(data) // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    return TensorDataset(rows)


def build(options: argparse.Namespace, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    """The Trainer of this script (``callbacks`` beside its checkpointing)."""
    checkpoints = ModelCheckpoint(dirpath=options.out / "checkpoints", save_top_k=-1,
                                  every_n_train_steps=options.save_every)  # fmt: skip
    return pl.Trainer(
        strategy=ZeroccStrategy(options.plan),  # was: strategy="deepspeed_stage_3"
        accelerator="cpu",
        devices=options.devices,
        max_steps=options.max_steps,
        accumulate_grad_batches=options.accumulate,
        gradient_clip_val=1.0,
        val_check_interval=options.save_every * options.accumulate,  # (counts batches)
        limit_val_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=[checkpoints, *callbacks],
        logger=CSVLogger(options.out, name="logs"),
        enable_model_summary=False,
    )


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default=str(HERE / "zero3.yaml"), help="plan YAML or DS JSON")
    parser.add_argument("--text", type=Path, default=Path(__file__), help="the text to learn")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per rank and batch")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--ckpt-path", default=None, help="a .ckpt to resume from")
    parser.add_argument("--out", type=Path, default=Path("lightning-run"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[pl.Callback] = ()) -> tuple:
    """Train; returns the Trainer and the module (which holds the trained weights)."""
    options = arguments(argv)
    pl.seed_everything(0)
    model = TinyGPT()
    rows = text_rows(options.text, model.hparams.seq_len)
    train = DataLoader(rows, batch_size=options.batch_size, shuffle=True, drop_last=True)
    val = DataLoader(rows, batch_size=options.batch_size)
    trainer = build(options, callbacks)
    trainer.fit(model, train, val, ckpt_path=options.ckpt_path)
    return trainer, model


if __name__ == "__main__":
    main()
