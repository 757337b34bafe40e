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
