"""`zerocc train` end to end: local gloo ranks through torch.distributed.run, with a summary.
(On GPUs: tests/test_cuda.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PLAN = Path(__file__).parent.parent / "examples" / "gpt" / "zero3.yaml"
# The example's `backend.device: auto` is this machine's: with its GPUs hidden, the ranks run on
# the CPU wherever the test runs (two ranks need two GPUs otherwise).
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_train_launches_two_ranks_and_summarizes():
    run = subprocess.run(
        [sys.executable, "-m", "zerocc", "train", str(PLAN), "--nproc", "2", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env=CPU_ONLY,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "world size 2" in out and "all_gather" in out and "reduce_scatter" in out
    assert "3 step(s) on 2 rank(s)" in out
    assert "model state per rank" in out and "(mean over 2 rank(s), up to step 3)" in out
