"""A step whose reduced gradient holds an inf or NaN, without loss scaling
(``precision.on_nonfinite``): ``error`` stops every rank naming the step and the unit, ``skip``
skips the step on every rank; either way no weight or optimizer state is written.

The model adds ``gain * second.bias[-1]`` to its loss; the batch's ``gain`` is 0 except at one
step on rank 0, where it is inf or NaN. So exactly one element of unit ``second``'s reduced
gradient is not finite, and with sharded gradients it lands in rank 1's shard: rank 0 knows only
through the all-reduced flags.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks
from optional_deps import marked, runnable
from torch import nn

import zerocc
from zerocc.errors import NonFiniteError
from zerocc.ir.nodes import FOUND_INF, info, op_name

BAD_STEP = 1  # the optimizer step (0-based) whose first micro-batch is poisoned on rank 0
STEPS = 3
UNITS = {"modules": ["first", "second"]}


class PoisonedBias(nn.Module):
    """Two units; the loss reads ``gain`` only through the last element of ``second.bias``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every run starts from the same weights
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        out = self.second(torch.tanh(self.first(x)))  # (B, 3)
        return F.mse_loss(out, y) + gain * self.second.bias[-1]


def batch(step: int, micro: int, rank: int, poison: float | None):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    bad = poison is not None and step == BAD_STEP and micro == 0 and rank == 0
    return (
        torch.randn(4, 6, generator=g),
        torch.randn(4, 3, generator=g),
        torch.tensor(poison if bad else 0.0),
    )


def plan_of(case: dict) -> dict:
    precision = dict(case.get("precision", {}))
    if case.get("mode"):
        precision["on_nonfinite"] = case["mode"]
    return {
        "zero": {"stage": case["stage"]},
        "units": UNITS,
        "optimizer": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01, **case.get("optimizer", {})},
        "grad_accumulation": case.get("accum", 1),
        "precision": precision,
        "backend": {
            "name": case.get("backend", "eager"),
            "kernels": case.get("kernels", "torch"),
            "device": "cpu",
        },
        "seed": 3,
    }


def name(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in sorted(case.items()))


def _local_state(step) -> tuple[dict[str, torch.Tensor], dict]:
    sd = step.state_dict()
    counters = dict(sd.pop("zerocc"))
    return {k: t.detach().clone() for k, t in sd.items()}, counters


def _train(rank: int, world: int, cases: list[dict]) -> dict[str, dict]:
    """Each case for STEPS steps (the reference cases leave out BAD_STEP); what the bad step did."""
    out = {}
    for case in cases:
        step = zerocc.compile(PoisonedBias(), plan_of(case))
        k, poison = case.get("accum", 1), case.get("poison")
        record: dict = {"errors": [], "losses": []}
        for s in range(STEPS):
            if s == BAD_STEP and poison is None:
                continue  # the run that never saw the bad batch
            if s == BAD_STEP:
                before, full_before = _local_state(step), step.full_state_dict()
            for micro in range(k):
                try:
                    loss = step(*batch(s, micro, rank, poison))
                    if s != BAD_STEP:
                        record["losses"].append(float(loss))
                except NonFiniteError as e:
                    record["errors"].append(str(e))
            if s == BAD_STEP:
                (after, counters), full_after = _local_state(step), step.full_state_dict()
                record["changed"] = [
                    n for n, t in before[0].items() if not torch.equal(t, after[n])
                ]
                record["full_changed"] = [
                    n for n, t in full_before.items() if not torch.equal(t, full_after[n])
                ]
                record["counters"] = (before[1], counters)
                record["skipped"] = step.skipped_steps
                record["summary_skipped"] = step.summary()["skipped_steps"]
        record["skipped_at_end"] = step.skipped_steps
        record["final"] = step.full_state_dict()
        record["explain"] = step.explain()
        out[name(case)] = record
    return out


FP16 = {"param": "fp16", "loss_scale": "none"}
CLIPPED = {"grad_clip": 0.05}
CONFIGS = [  # (config, poison)
    *[({"stage": s}, float("inf")) for s in range(4)],
    *[({"stage": s, "precision": {"param": "bf16"}}, float("nan")) for s in range(4)],
    ({"stage": 2, "precision": FP16}, float("-inf")),
    ({"stage": 3, "precision": {"param": "bf16"}, "accum": 2, "optimizer": CLIPPED}, float("inf")),
    ({"stage": 1, "accum": 2, "optimizer": CLIPPED}, float("nan")),
    (
        {"stage": 2, "precision": {"param": "bf16"}, "optimizer": CLIPPED, "kernels": "triton"},
        float("inf"),
    ),
    # The whole program compiled by Inductor, the checks its own kernels (min/max reductions
    # that must propagate a NaN as ATen's do).
    ({"stage": 3, "backend": "inductor-whole"}, float("nan")),
    (
        {
            "stage": 2,
            "precision": {"param": "bf16"},
            "optimizer": CLIPPED,
            "backend": "inductor-whole",
        },
        float("-inf"),
    ),
]
# Configs also run without the bad step: the poisoned runs must end exactly where they do.
WITH_REFERENCE = [c for c, _ in CONFIGS if {"accum", "kernels", "backend"} & c.keys()]


def _cases() -> list[dict]:
    cases = [{**c, "mode": m, "poison": p} for c, p in CONFIGS for m in ("error", "skip")]
    return cases + [dict(c) for c in WITH_REFERENCE]


@functools.cache
def _results() -> list[dict[str, dict]]:
    return run_ranks(2, _train, runnable(_cases()))


def _bad_step_of(config: dict, poison: float, mode: str) -> list[dict]:
    return [ranks[name({**config, "mode": mode, "poison": poison})] for ranks in _results()]


def _poison_id(value: tuple) -> str:
    config, poison = value
    return name({**config, "poison": poison})


@pytest.mark.parametrize("config", marked(CONFIGS, lambda c: c[0]), ids=_poison_id)
def test_error_stops_every_rank_naming_the_step_and_unit_and_writes_nothing(config):
    config, poison = config
    for rank, record in enumerate(_bad_step_of(config, poison, "error")):
        (message,) = record["errors"]
        assert f"rank {rank}, step {BAD_STEP + 1}:" in message, message
        assert "unit 'second'" in message and "'first'" not in message, message
        assert "on_nonfinite: skip" in message, message
        # Weights, masters, moments, gradient accumulators: bit-identical to before the step.
        assert record["changed"] == [] and record["full_changed"] == [], record["changed"]
        # The step's micro-batches were discarded: counters as before it, nothing skipped.
        before, after = record["counters"]
        assert before == after and record["skipped"] == 0
        assert all(torch.isfinite(torch.tensor(record["losses"])))


@pytest.mark.parametrize("config", marked(CONFIGS, lambda c: c[0]), ids=_poison_id)
def test_skip_skips_the_step_on_every_rank_and_writes_nothing(config):
    config, poison = config
    skipped = _bad_step_of(config, poison, "skip")
    failed = _bad_step_of(config, poison, "error")
    for rank, record in enumerate(skipped):
        assert record["errors"] == []
        assert record["changed"] == [] and record["full_changed"] == [], record["changed"]
        before, after = record["counters"]
        assert after["steps"] == before["steps"] == BAD_STEP
        assert after["micro_batches"] == before["micro_batches"] + config.get("accum", 1)
        assert record["skipped"] == record["summary_skipped"] == record["skipped_at_end"] == 1
        assert "1 of 3 steps skipped" in record["explain"], record["explain"]
        # The step after trains on, as the run that stopped with an error and went on did.
        assert record["losses"] == failed[rank]["losses"]
    final, stopped = skipped[0]["final"], failed[0]["final"]
    assert all(torch.equal(t, stopped[n]) for n, t in final.items())


@pytest.mark.parametrize("config", marked(WITH_REFERENCE), ids=name)
def test_a_skipped_or_stopped_step_is_as_if_its_batch_never_came(config):
    poison = next(p for c, p in CONFIGS if c == config)
    reference = [ranks[name(config)] for ranks in _results()]
    for mode in ("error", "skip"):
        ours = _bad_step_of(config, poison, mode)
        for rank in range(2):
            assert ours[rank]["losses"] == reference[rank]["losses"], (mode, rank)
        final = ours[0]["final"]
        assert all(torch.equal(t, reference[0]["final"][n]) for n, t in final.items()), mode
        assert not all(  # and training did move the weights (the checks above could fail)
            torch.equal(t, reference[0]["final"][n]) for n, t in _initial(config).items()
        )


def _initial(config: dict) -> dict[str, torch.Tensor]:
    return zerocc.compile(PoisonedBias(), plan_of(config)).full_state_dict()


# --- the program: one check before every update, whatever moves nodes after ----------------


def _program(plan: dict) -> torch.fx.GraphModule:
    step = zerocc.compile(PoisonedBias(), plan, comm=zerocc.FakeComm(2))
    step(*batch(0, 0, 0, None))
    return step.program


def _updates(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if op_name(n.target) in ("zerocc.adamw_", "zerocc.sgd_")]


PROGRAMS = {
    "stage0": {"zero": {"stage": 0}},
    "stage3-bf16-clip": {
        "zero": {"stage": 3},
        "precision": {"param": "bf16"},
        "optimizer": CLIPPED,
    },
    "stage2-sgd-offload-buckets": {
        "zero": {"stage": 2},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "offload": {"optimizer": "cpu", "ratio": 0.5},
        "overlap": {"bucket_mb": 1},
    },
}


@pytest.mark.parametrize("plan", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_every_update_waits_for_the_check_of_every_gradient(plan):
    gm = _program({"units": UNITS, **plan})
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # One check, or (gradients offloaded to the host) one per gradient once it is complete.
    checks = [n for n in gm.graph.nodes if op_name(n.target) == "zerocc.nonfinite_flags"]
    updates = _updates(gm)
    assert (
        {info(g).unit for check in checks for g in check.args[0]}
        == {info(u).unit for u in updates}
        == {
            "first",
            "second",
        }
    )
    (gate,) = [n for n in gm.graph.nodes if info(n).role == FOUND_INF]
    for update in updates:
        flag = update.args[6 if op_name(update.target) == "zerocc.adamw_" else 4]
        # The update reads the gate (or, on the host, a copy of it): data order, which no pass
        # that moves nodes can break.
        assert flag is gate or gate in flag.all_input_nodes[0].all_input_nodes, update
        assert order[gate] < order[update]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert output.args[0][-1] is gate
    clipped = "grad_clip" in plan.get("optimizer", {})
    # the clip's squared norm comes from the same read
    assert all(check.args[2] is clipped for check in checks)
    assert not [n for n in gm.graph.nodes if op_name(n.target) == "zerocc.sum_squares"]


def test_loss_scaled_fp16_keeps_its_own_overflow_check():
    gm = _program({"units": UNITS, "zero": {"stage": 2}, "precision": {"param": "fp16"}})
    names = [op_name(n.target) for n in gm.graph.nodes]
    assert "zerocc.unscale_check_" in names and "zerocc.nonfinite_flags" not in names


def test_one_rank_error_leaves_a_usable_step():
    """One process, no process group: the error, then the next batches train on."""
    step = zerocc.compile(PoisonedBias(), plan_of({"stage": 0}))
    step(*batch(0, 0, 0, None))
    with pytest.raises(NonFiniteError, match=r"rank 0, step 2: .*unit 'second'"):
        step(*batch(BAD_STEP, 0, 0, float("nan")))
    assert (step.steps, step.micro_batches, step.skipped_steps) == (1, 1, 0)
    step(*batch(2, 0, 0, None))
    assert (step.steps, step.micro_batches) == (2, 2)
    assert "non-finite gradients: error" in step.explain()


def test_offloaded_gradients_checked_one_by_one_still_name_the_unit():
    """The optimizer on the host: each gradient is checked once complete (one check per
    gradient, combined where the step's check was, so the device holds none to the end of
    backward); the error still names the unit whose gradient is not finite and writes
    nothing."""
    plan = {**plan_of({"stage": 3, "optimizer": CLIPPED}), "offload": {"optimizer": "cpu"}}
    step = zerocc.compile(PoisonedBias(), plan)
    step(*batch(0, 0, 0, None))
    checks = [n for n in step.program.graph.nodes if op_name(n.target) == "zerocc.nonfinite_flags"]
    assert [[info(g).unit for g in c.args[0]] for c in checks] == [["second"], ["first"]]
    before = {k: v.clone() for k, v in step.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(NonFiniteError, match=r"rank 0, step 2: .*unit 'second'"):
        step(*batch(BAD_STEP, 0, 0, float("nan")))
    after = step.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_huge_but_finite_gradient_is_not_non_finite():
    """Its squared norm overflows to inf (the clip then scales the step to nothing); the step is
    applied, not stopped: only an inf or NaN in the gradient itself counts."""
    step = zerocc.compile(PoisonedBias(), plan_of({"stage": 0, "optimizer": CLIPPED}))
    step(*batch(BAD_STEP, 0, 0, 1e30))
    assert (step.steps, step.skipped_steps) == (1, 0)
