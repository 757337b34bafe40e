"""What `zerocc train` records: the plan's `metrics` section and its flags.

The oracle for the pooled loss is the model itself: the first record is of the first step,
whose loss on each rank is the initial model's on that rank's first batch, so the record must
hold their mean (to fp32 rounding, 1e-6). The rates are the schedule's
(zerocc.compiler.schedule, itself held to torch's schedulers in tests/compiler/test_schedule.py);
model FLOPs are held to torch's FlopCounterMode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from models import build, entry, loss_of

import zerocc
from zerocc.cli.metrics import Metrics, model_flops, peak_flops
from zerocc.compiler.schedule import lr_at

EXAMPLE = Path(__file__).parents[2] / "examples" / "gpt"
SMALL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32, "batch_size": 4}
SCHEDULE = {"name": "cosine", "warmup_steps": 2, "total_steps": 5}


def _plan(tmp_path: Path) -> Path:
    plan = {
        "workload": "workload:workload",
        "workload_args": SMALL,
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-3, "schedule": SCHEDULE},
        "backend": {"device": "cpu"},
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_train_records_loss_lr_throughput_and_eval(tmp_path):
    plan = _plan(tmp_path)
    records, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    command = [sys.executable, "-m", "zerocc", "train", str(plan), "--nproc", "2"]
    command += ["--steps", "6", "--metrics", str(records), "--tensorboard", str(board)]
    command += ["--eval-every", "4"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(EXAMPLE)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    trained = [r for r in lines if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6]
    optimizer = zerocc.load_plan(plan).optimizer
    assert [r["lr"] for r in trained] == [lr_at(optimizer, n) for n in range(6)]
    assert all(r["tokens_per_s"] > 0 and r["steps_per_s"] > 0 for r in trained[1:])
    assert "tokens_per_s" not in trained[0]  # the first step's time is its compilation
    evals = [r["step"] for r in lines if "eval_loss" in r]
    assert evals == [4, 6]  # every 4 steps, and at the end
    assert trained[0]["loss"] == pytest.approx(_first_losses_mean(), rel=1e-6)
    out = run.stdout + run.stderr
    assert f"final loss: {trained[-1]['loss']:.4f} (mean over 2 rank(s), up to step 6)" in out
    assert "eval loss" in out
    _check_tensorboard(board, trained)


def _first_losses_mean() -> float:
    sys.path.insert(0, str(EXAMPLE))
    from workload import workload

    work = workload(**SMALL)
    losses = []
    for rank in range(2):
        batch = next(work.batches(rank, 2))
        with torch.no_grad():
            losses.append(float(work.model(*batch)))
    return sum(losses) / 2


def _check_tensorboard(folder: Path, trained: list[dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [r["step"] for r in trained]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in trained], rel=1e-6)
    assert len(events.Scalars("eval/loss")) == 2


def test_model_flops_are_three_forwards():
    """Against FlopCounterMode on a model of linear layers (its registry has no entry for the
    CPU flash-attention kernel, which zerocc's cost model counts)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, batch = build("buffers"), entry("buffers")[1](0, 0)
    with FlopCounterMode(display=False) as counter:
        loss_of(model(*batch))
    expected = 3 * counter.get_total_flops()
    assert expected > 0
    plan = {"zero": {"stage": 3}, "units": entry("buffers")[2]}
    step = zerocc.compile(model, plan, comm=zerocc.FakeComm(world_size=2))
    step(*batch)
    assert model_flops(step.program) == pytest.approx(expected, rel=1e-6)


def test_peak_flops_are_the_plans_or_known():
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "bf16", None) is None  # no MFU on a CPU unless the plan says
    assert peak_flops(cpu, "bf16", 100.0) == 100e12


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    plan = zerocc.load_plan({"metrics": {"tensorboard": str(tmp_path)}})
    step = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(zerocc.NotSupportedError, match="pip install tensorboard"):
        Metrics(step, plan, SimpleNamespace(), rank=0)
