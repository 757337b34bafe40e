"""The GPT example as a zerocc workload: `workload: "workload:workload"` in a plan names it."""

import data
import torch
from model import GPT, GPTConfig

from zerocc import Workload


def workload(
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    vocab_size: int | None = None,
    device: str = "cpu",
) -> Workload:
    """A char-level GPT on the embedded text; `batch_size` is per rank. ``device: meta`` builds
    it without memory (zerocc materializes it one unit at a time, or just inspects it);
    ``vocab_size`` pads the vocabulary beyond the text's characters (as LLM vocabularies are)."""
    torch.manual_seed(seed)  # every rank builds the same initial weights
    config = GPTConfig(
        vocab_size=vocab_size or data.vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
    )
    with torch.device(device):
        model = GPT(config)
    return Workload(
        model,
        loss_fn=None,  # GPT.forward(idx, targets) returns the loss
        batches=lambda rank, world_size: data.batches(
            rank, world_size, batch_size=batch_size, block_size=block_size, seed=seed
        ),
        eval_batches=lambda rank, world_size: data.eval_batches(
            rank, world_size, batch_size=batch_size, block_size=block_size
        ),
        tokens_per_batch=lambda batch: batch[0].numel(),
    )
