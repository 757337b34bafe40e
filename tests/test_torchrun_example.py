"""examples/torchrun/train.py, docs/integrations.md's own-training-loop example, as a user runs it:
`torchrun --nproc_per_node 2` on CPU (gloo), its plan beside it, a checkpoint at the end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import zerocc

SCRIPT = Path(__file__).parent.parent / "examples" / "torchrun" / "train.py"


def test_the_torchrun_example_trains_and_saves(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command = [*launch, "--standalone", str(SCRIPT), "--steps", "10", "--save", str(tmp_path)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", run.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # steps 1, 5 and 10
    lrs = [float(x) for x in re.findall(r"lr ([\d.e+-]+)", run.stdout)]
    assert lrs[0] == 0.0 and lrs[1] > 0  # the plan's warmup, from 0
    assert "saved" in run.stdout and (tmp_path / "step-00000010").is_dir()
    assert zerocc.load_plan(SCRIPT.parent / "plan.yaml").zero.stage == 3
