"""The loss-scale rule, step by step: backoff with hysteresis, growth, floor, static scales."""

from __future__ import annotations

import torch

from zerocc.compiler.plan import load_plan
from zerocc.runtime.loss_scale import LossScaler


def scaler(**precision) -> LossScaler:
    plan = load_plan({"precision": {"param": "fp16", **precision}})
    return LossScaler.of(plan.precision, torch.zeros(()))


def run(s: LossScaler, overflows: str) -> list[float]:
    """Scales after each step of a pattern like '..x.' (x: an overflowing step)."""
    out = []
    for c in overflows:
        s.update(c == "x")
        out.append(s.scale)
    return out


def test_hysteresis_tolerates_overflows_before_backing_off():
    s = scaler(dynamic={"initial": 64, "hysteresis": 2, "growth_interval": 100})
    assert run(s, "xxx.x") == [64, 32, 16, 16, 8]
    assert s.skipped_steps == 4 and float(s.tensor) == 8


def test_growth_after_the_interval_refills_hysteresis():
    s = scaler(dynamic={"initial": 8, "hysteresis": 2, "growth_interval": 2})
    assert run(s, "x...x..x") == [8, 8, 16, 16, 16, 16, 32, 32]
    assert s.hysteresis_left == 1  # refilled to 2 by the growth, one overflow since


def test_backoff_stops_at_the_minimum_scale():
    s = scaler(dynamic={"initial": 4, "hysteresis": 1, "min_scale": 2})
    assert run(s, "xxx") == [2, 2, 2]


def test_a_static_scale_never_changes_but_counts_skips():
    s = scaler(loss_scale=128)
    assert run(s, "x..x") == [128] * 4 and s.skipped_steps == 2


def test_state_round_trips():
    s = scaler(dynamic={"initial": 64, "hysteresis": 1})
    run(s, "x..")
    t = scaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() and float(t.tensor) == 32


def test_growth_stops_at_the_largest_scale_a_plan_allows():
    s = scaler(dynamic={"initial": 2.0**31, "growth_factor": 1000, "growth_interval": 1})
    assert run(s, "...") == [2.0**32] * 3  # not inf, which would skip every later step
