"""examples/huggingface/trainer_sft.py, docs/integrations.md's Trainer script, as a user runs
it: `torchrun --nproc_per_node 2` on CPU (gloo), the JSONL documents beside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason='the Trainer needs accelerate: pip install -e ".[dev]"')

SCRIPT = Path(__file__).parents[2] / "examples" / "huggingface" / "trainer_sft.py"


def test_the_trainer_example_trains_evaluates_and_saves(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command = [*launch, "--standalone", str(SCRIPT), "--max-steps", "4", "--out", str(tmp_path)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"'loss': '([\d.]+)'", run.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert re.search(r"'eval_loss': '[\d.]+'", run.stdout)
    assert (tmp_path / "checkpoint-4" / "zerocc" / "step-00000004").is_dir()
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert (tmp_path / "final" / "tokenizer.json").is_file()
