"""`zerocc train --save / --resume`: a run killed and resumed trains as the run that never
stopped; SIGTERM (what schedulers send before preemption) saves before the ranks exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _train(*flags: str, nproc: int = 2) -> str:
    command = [sys.executable, "-m", "zerocc", "train", str(PLAN), "--nproc", str(nproc), *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def _final_loss(out: str) -> str:
    return re.search(r"final loss: (\S+)", out).group(1)


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    saves = tmp_path / "ckpt"
    out = _train("--steps", "4", "--save", str(saves), "--save-every", "2", "--keep", "1")
    assert sorted(p.name for p in saves.iterdir()) == ["latest", "step-00000004"]
    assert f"checkpoint: {saves / 'step-00000004'}" in out
    resumed = _train("--steps", "6", "--resume", str(saves))
    assert "resumed from" in resumed and "at micro-batch 4" in resumed
    assert "2 step(s) on 2 rank(s)" in resumed
    assert _final_loss(resumed) == _final_loss(_train("--steps", "6"))


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_a_checkpoint_before_the_ranks_exit(tmp_path, nproc):
    """One rank runs in the command's process; two run under torch's launcher, which passes
    the signal on to them."""
    saves = tmp_path / "ckpt"
    command = [
        sys.executable, "-u", "-m", "zerocc", "train", str(PLAN), "--nproc", str(nproc),
        "--steps", "100000", "--save", str(saves),
    ]  # fmt: skip
    env = {**CPU_ONLY, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # the explanation is printed once the first step has run
        lines.append(line)
        if "model states per rank" in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == (0 if nproc == 1 else 128 + signal.SIGTERM), out[-3000:]
    assert "stopped by SIGTERM after micro-batch" in out, out[-3000:]
    manifest = json.loads((saves / (saves / "latest").read_text().strip() / "manifest.json")
                          .read_text())  # fmt: skip
    assert manifest["meta"]["step"] >= 1 and manifest["meta"]["world_size"] == nproc
