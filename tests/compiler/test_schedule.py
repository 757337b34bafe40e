"""optimizer.schedule: the rate of every step against the schedulers it names.

Hugging Face Trainer's schedules against torch.optim.lr_scheduler (composed from torch's own
LinearLR / CosineAnnealingLR / LambdaLR, stepped as a training loop steps them); DeepSpeed's
against the rates its own classes gave (tests/fixtures/lr_schedules/deepspeed.json, written by
make_deepspeed.py there; rerun live where DeepSpeed is installed). Rates agree to 1e-12
relative: the same formulas in float64, torch's recursive forms rounding differently.
Training parity with a schedule is in tests/parity/test_schedule_parity.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from parity import torch_scheduler

import zerocc
from zerocc.compiler.schedule import lr_at

FIXTURES = Path(__file__).parents[1] / "fixtures" / "lr_schedules"
DEEPSPEED = json.loads((FIXTURES / "deepspeed.json").read_text())["cases"]


def _optimizer(lr: float, **schedule) -> zerocc.Plan:
    return zerocc.load_plan({"optimizer": {"lr": lr, "schedule": schedule}}).optimizer


def torch_rates(schedule: dict, lr: float, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = torch_scheduler(schedule, opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


TRAINER = [
    {"name": "constant", "warmup_steps": 4},
    {"name": "constant"},
    {"name": "linear", "warmup_steps": 3, "total_steps": 12},
    {"name": "linear", "warmup_steps": 0, "total_steps": 7, "min_lr": 1e-4},
    {"name": "cosine", "warmup_steps": 5, "total_steps": 25},
    {"name": "cosine", "warmup_steps": 2, "total_steps": 9, "min_lr": 2e-4},
]


@pytest.mark.parametrize("schedule", TRAINER, ids=lambda s: "-".join(map(str, s.values())))
def test_trainer_schedules_match_torch(schedule):
    """Through warmup and the whole decay (torch's cosine is periodic past its end, so the
    comparison stops there; zerocc holds the end, checked below)."""
    lr = 1e-3
    steps = schedule.get("total_steps", 10) + 1
    expected = torch_rates(schedule, lr, steps)
    ours = [lr_at(_optimizer(lr, **schedule), n) for n in range(steps)]
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_decay_holds_its_end_after_total_steps():
    cosine = _optimizer(1e-3, name="cosine", warmup_steps=2, total_steps=10, min_lr=1e-5)
    assert lr_at(cosine, 10) == pytest.approx(1e-5) and lr_at(cosine, 50) == lr_at(cosine, 10)
    linear = _optimizer(1e-3, name="linear", total_steps=10)
    assert lr_at(linear, 10) == 0.0 and lr_at(linear, 11) == 0.0


@pytest.mark.parametrize("case", DEEPSPEED, ids=lambda c: "-".join(map(str, c["schedule"])))
def test_deepspeed_schedules_match_deepspeed(case):
    optimizer = _optimizer(case["lr"], **case["schedule"])
    ours = [lr_at(optimizer, n) for n in range(len(case["rates"]))]
    assert ours == pytest.approx(case["rates"], rel=1e-12, abs=1e-18)


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (`DS_BUILD_OPS=0 pip install deepspeed`); the recorded "
    "rates in tests/fixtures/lr_schedules/deepspeed.json are checked without it",
)
def test_recorded_deepspeed_rates_are_deepspeeds():
    sys.path.insert(0, str(FIXTURES))
    from make_deepspeed import rates

    for case in DEEPSPEED:
        assert rates(case["schedule"], case["lr"], len(case["rates"])) == case["rates"]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({"name": "cosine", "warmup_steps": 3}, "needs total_steps"),
        ({"name": "cosine", "warmup_steps": 5, "total_steps": 5}, "larger than warmup_steps"),
        ({"name": "linear", "total_steps": 9, "warmup_num_steps": 3}, "does not apply"),
        ({"name": "warmup_decay_lr"}, "needs total_num_steps"),
        ({"name": "cosine", "total_steps": 9, "min_lr": 0.1}, "must be below lr"),
        ({"name": "warmup_lr", "warmup_max_lr": 5.0}, "too large"),
        ({"name": "warmup_lr", "warmup_min_lr": 0.5, "warmup_max_lr": 0.1}, "warmup_min_lr"),
        ({"name": "step"}, "constant"),
    ],
)
def test_bad_schedules_are_plan_errors(schedule, message):
    with pytest.raises(zerocc.PlanError, match=message):
        _optimizer(1e-3, **schedule)
