"""Plans one change away that need less memory (what InsufficientMemoryError proposes)."""

from __future__ import annotations

import torch

from zerocc.compiler.driver.plan_changes import plan_changes, smallest_world_size
from zerocc.compiler.plan import load_plan

CPU = torch.device("cpu")


def test_plan_changes_are_valid_plans_one_change_away():
    stage0 = load_plan({"zero": {"stage": 0}})
    texts = _texts(stage0, torch.device("cuda", 0))
    assert "zero.stage: 1, offload.optimizer: cpu" in texts
    assert "zero.stage: 3, offload.optimizer: cpu, offload.params: cpu" in texts
    assert not any("offload.optimizer: cpu" in t for t in _texts(stage0, CPU))  # same memory
    listed = load_plan({"passes": ["partition", "shard", "optimizer", "overlap"]})
    assert not any("offload" in t for t in _texts(listed, CPU))  # `passes` lacks it: invalid


def test_an_offloaded_optimizer_may_keep_its_gradients_on_the_gpu():
    offloaded = load_plan({"zero": {"stage": 3}, "offload": {"optimizer": "cpu"}})
    assert "offload.grads: device" in _texts(offloaded, torch.device("cuda", 0))
    assert "offload.grads: device" not in _texts(offloaded, CPU)  # the same memory
    pipelined = load_plan(
        {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "defer_updates": "next_forward"}}
    )
    assert "offload.grads: device" not in _texts(pipelined, torch.device("cuda", 0))  # invalid


def test_gradients_unbounded_on_their_way_to_the_host_may_be_bounded():
    unbounded = load_plan(
        {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "grads_in_flight": None}}
    )
    assert "offload.grads_in_flight: 1" in _texts(unbounded, torch.device("cuda", 0))
    tightest = load_plan(
        {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "grads_in_flight": 1}}
    )
    assert not any("grads_in_flight" in t for t in _texts(tightest, CPU))


def _texts(plan, device) -> list[str]:
    return [c.text for c in plan_changes(plan, device, recompute=True)]


def test_smallest_world_size_is_the_first_that_fits():
    assert smallest_world_size(lambda n: 1000 // n <= 7, 4) == 126
    assert smallest_world_size(lambda n: False, 4) is None
