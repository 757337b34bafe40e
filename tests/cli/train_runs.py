"""What the `zerocc train` tests read off a run they launch: the environment they launch it
in (CPU ranks, whatever the machine has), its final loss, its checkpoint's digests."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# The example's `backend.device: auto` is this machine's: with its GPUs hidden, the ranks run on
# the CPU wherever the test runs (two ranks need two GPUs otherwise).
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def final_loss(out: str) -> str:
    """The final loss a run printed, as printed."""
    return re.search(r"final loss: (\S+)", out).group(1)


def checkpoint_digests(folder: Path) -> dict[str, list[str]]:
    """Each tensor's chunk digests in the checkpoint ``folder``: equal when every tensor is
    equal bit for bit."""
    tensors = json.loads((folder / "manifest.json").read_text())["tensors"]
    return {name: [c["digest"] for c in entry["chunks"]] for name, entry in tensors.items()}


ONE_RANK_PLAN = {"zero": {"stage": 3}, "units": {"classes": ["Block"]},
                 "backend": {"device": "cpu", "kernels": "torch"}}  # fmt: skip


def one_rank_saves(root: Path) -> Path:
    """Two checkpoints of one rank in ``root`` (steps 1 and 2 of the test GPT), for the
    commands that read a checkpoint folder."""
    import torch
    from models import build

    import zerocc

    step = zerocc.compile(build("gpt"), ONE_RANK_PLAN)
    x = torch.randint(0, 32, (2, 8))
    for _ in range(2):
        step(x, x)
        step.save(root)
    return root
