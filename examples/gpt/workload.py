"""The GPT example as a zerocc workload: `workload: "workload:workload"` in a plan names it."""

import data
import torch
from model import GPT, GPTConfig

from zerocc import PlanError, Workload, plan_relative


def workload(
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    vocab_size: int | None = None,
    device: str = "cpu",
    data: str | None = None,
) -> Workload:
    """A GPT on the embedded text, char-level, or on ``data`` (a text file, char-level over its
    own characters, or token files: ``.bin`` as nanoGPT writes them, ``.npy``, or a folder of
    them; relative to the plan's folder; ``zerocc train --data PATH``); `batch_size` is per
    rank. ``device: meta`` builds it without memory (zerocc materializes it one unit at a time,
    or just inspects it); ``vocab_size`` pads the vocabulary beyond the data's tokens (as LLM
    vocabularies are)."""
    if batch_size < 1:
        raise PlanError(f"workload_args.batch_size: {batch_size}; give 1 or more (per rank)")
    corpus = _corpus(data)
    if vocab_size is not None and vocab_size < corpus.vocab_size:
        raise PlanError(
            f"workload_args.vocab_size: {vocab_size} is fewer than the data's "
            f"{corpus.vocab_size} token ids; leave it out, or give {corpus.vocab_size} or more"
        )
    torch.manual_seed(seed)  # every rank builds the same initial weights
    config = GPTConfig(
        vocab_size=vocab_size or corpus.vocab_size,
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
        batches=lambda rank, world_size: data_module.batches(
            rank, world_size, batch_size, block_size, seed=seed, corpus=corpus
        ),
        eval_batches=lambda rank, world_size: data_module.eval_batches(
            rank, world_size, batch_size, block_size, corpus=corpus
        ),
        tokens_per_batch=lambda batch: batch[0].numel(),
    )


data_module = data  # (the module; ``data`` is also the workload's argument)


def _corpus(path: str | None) -> data.Corpus:
    if path is None:
        return data.EMBEDDED
    try:
        return data.load(plan_relative(path))
    except (ValueError, OSError) as exc:
        raise PlanError(f"workload_args.{exc}") from None
