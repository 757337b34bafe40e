"""Your own training loop with zerocc: launch with torchrun, one process per rank.

    torchrun --nproc_per_node 2 examples/torchrun/train.py --steps 20 --save ckpt/

The model is the GPT example's, the data the GPT example's text as fixed windows; the loader
is a plain DataLoader with a DistributedSampler, the loop is yours. zerocc.compile joins the
process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR), shards the model by the plan
and returns the step: forward, backward, communication and the optimizer update in one call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zerocc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gpt"))  # the GPT example's model and text
import data  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def windows(block_size: int) -> TensorDataset:
    """Every block_size window of the text and the window one character on."""
    starts = range(0, len(data.tokens) - block_size - 1, block_size // 2)
    inputs = torch.stack([data.tokens[s : s + block_size] for s in starts])
    targets = torch.stack([data.tokens[s + 1 : s + 1 + block_size] for s in starts])
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", default=str(HERE / "plan.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--save", help="save a checkpoint here at the end")
    args = parser.parse_args()

    torch.manual_seed(0)  # zerocc starts every rank from rank 0's weights anyway
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=64, n_layer=2, n_head=4,
                          n_embd=64))  # fmt: skip
    step = zerocc.compile(model, args.plan)  # GPT.forward(idx, targets) returns the loss
    rank, world = step.comm.rank, step.comm.world_size

    dataset = windows(block_size=64)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)  # fmt: skip
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    done, epoch = 0, 0
    while done < args.steps:
        sampler.set_epoch(epoch)  # another shuffle each epoch, the same on every rank
        for inputs, targets in loader:
            lr = step.lr  # the rate of the update this step makes (the plan's schedule)
            loss = step(inputs, targets)  # this rank's micro-batch; the step syncs the ranks
            done += 1
            if rank == 0 and (done % 5 == 0 or done == 1):
                print(f"step {done}: loss {loss.item():.4f} (rank 0), lr {lr:.2e}", flush=True)
            if done == args.steps:
                break
        epoch += 1

    if args.save:
        path = step.save(args.save)  # every rank writes its own slices
        if rank == 0:
            print(f"saved {path}")


if __name__ == "__main__":
    main()
