"""`zerocc train examples/gpt/zero3.yaml --set optimizer.name=muon`: Muon at ZeRO-3 on 2 ranks
trains the example GPT (its loss falls), and a run resumed from its checkpoint (the momentum
and AdamW moments, flat shards) ends where the uninterrupted one does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from train_runs import CPU_ONLY, final_loss

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"
MUON = ("--set", "optimizer.name=muon", "--set", "optimizer.lr=0.02")


def _train(*flags: str) -> str:
    command = [sys.executable, "-m", "zerocc", "train", str(PLAN), "--nproc", "2", *MUON, *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def test_muon_trains_the_example_gpt_and_resumes(tmp_path):
    saves = tmp_path / "ckpt"
    out = _train("--steps", "4", "--save", str(saves), "--save-every", "2", "--keep", "2")
    losses = [float(x) for x in re.findall(r"loss=([0-9.]+)", out)]
    assert losses and float(final_loss(out)) < losses[0] - 0.5, out[-2000:]
    resumed = _train("--steps", "4", "--resume", str(saves / "step-00000002"))
    assert "2 step(s) on 2 rank(s)" in resumed
    assert final_loss(resumed) == final_loss(out)
