"""offload.defer_updates in one process: host updates carried into the next step.

``next_forward`` must train bit-identically to the plan without it, whatever reads the state
between steps (a state_dict, an evaluation, a save and a resume), and whether the host's worker
runs the updates on a thread (a GPU machine) or where they are issued (a CPU one). ``delayed``
is checked against a delayed-update reference on two gloo ranks (tests/parity).
"""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt
from optional_deps import needs_triton

import zerocc
from zerocc.engine.host_worker import HostWorker
from zerocc.errors import PlanError

SCALES = [1.0, 1.0, float("inf"), 1.0, 1.0]  # the loss's scale: inf skips step 2
ADAMW = {"name": "adamw", "lr": 1e-2, "grad_clip": 0.5}
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
FP32 = {"on_nonfinite": "skip"}  # (the plans' default precision is bf16 compute)


def _plan(deferral: str, optimizer: dict = ADAMW, stage: int = 3, **offload) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": optimizer,
        "precision": {"param": "bf16", "on_nonfinite": "skip"},
        "offload": {"optimizer": "cpu", "defer_updates": deferral, **offload},
    }


def _step(plan: dict) -> zerocc.TrainStep:
    """Two simulated ranks under stage 3; one under stages 1-2, whose whole weights a
    FakeComm's all-gather would fill with this rank's shard alone (every simulated rank's)."""
    torch.manual_seed(0)
    comm = zerocc.FakeComm(world_size=2 if plan["zero"]["stage"] == 3 else 1)
    return zerocc.compile(tiny_gpt(), plan, comm=comm, loss_fn=lambda m, x, y, s: m(x, y) * s)


def _train(step: zerocc.TrainStep, first: int, last: int) -> list[float]:
    return [float(step(*_gpt_batch(i, 0), torch.tensor(SCALES[i]))) for i in range(first, last)]


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def threaded(request, monkeypatch) -> bool:
    """Host updates where they are issued (a CPU machine), or on the worker's thread."""
    if request.param:
        monkeypatch.setattr(
            "zerocc.runtime.context.HostWorker", lambda threaded: HostWorker(threaded=True)
        )
    return request.param


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"offload": {"params": "cpu", "ratio": 0.5}},
        {"optimizer": SGD},
        {"backend": {"kernels": "one-pass"}},
        # Triton's (interpreted): its first carried update, skipped, writes the copy too.
        pytest.param({"backend": {"kernels": "triton"}}, marks=needs_triton),
        # No compute copy: the update writes the fp32 weights, on the host with its states.
        {"offload": {"params": "cpu"}, "precision": FP32},
        # The whole weights, of which the rank's shard is all (tests/parity: 2 gloo ranks).
        {"zero": {"stage": 2}},
        {"zero": {"stage": 1}, "offload": {"ratio": 0.5}},
    ],
    ids=["all", "half-params-on-host", "sgd", "one-pass", "triton", "fp32-params-on-host",
         "stage2", "stage1-half"],
)  # fmt: skip
def test_next_forward_trains_bit_identically_to_the_plan_without_it(change, threaded):
    """bf16 compute copies written by the carried updates through two host buffers, a clip,
    and a step skipped for a non-finite loss (its carried update must write nothing); the
    one-pass loop (a GPU machine's host update, compiled) called from the worker's thread."""

    def plan(mode: str) -> dict:
        base = _plan(mode, change.get("optimizer", ADAMW), **change.get("offload", {}))
        return {**base, **{k: v for k, v in change.items() if k not in ("optimizer", "offload")}}

    steps = {mode: _step(plan(mode)) for mode in ("none", "next_forward")}
    losses = {mode: _train(step, 0, len(SCALES)) for mode, step in steps.items()}
    assert losses["next_forward"] == losses["none"]
    deferred, plain = steps["next_forward"], steps["none"]
    assert deferred.summary()["skipped_steps"] == plain.summary()["skipped_steps"] == 1
    assert deferred.context.host.threaded is threaded
    ours, theirs = deferred.state_dict(), plain.state_dict()  # optimizer states too
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
    # Still bit-identical after the state_dict applied the update early: the next step skips it.
    assert _train(deferred, 3, 5) == _train(plain, 3, 5)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("deferral", ["next_forward", "delayed"])
def test_an_evaluation_sees_the_carried_update_applied(deferral, stage):
    """fp32 (losses to the last bit): what evaluate computes on is the model as trained so far,
    the last step's carried update included (the materialized model applies it too)."""
    plan = {**_plan(deferral, stage=stage), "precision": FP32}
    step = _step(plan)
    _train(step, 0, 2)
    x, y = _gpt_batch(9, 0)
    evaluated = float(step.evaluate(x, y, torch.tensor(1.0)))
    model = step.materialize_model().eval()
    with torch.no_grad():
        assert evaluated == pytest.approx(float(model(x, y)), rel=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("deferral", ["next_forward", "delayed"])
def test_a_resumed_run_trains_as_the_run_that_saved(deferral, stage, tmp_path):
    """A save applies the update in flight; a run loading that checkpoint goes on exactly as
    the one that saved it."""
    plan = _plan(deferral, stage=stage)
    saving = _step(plan)
    _train(saving, 0, 2)
    saving.save(tmp_path)
    resumed = _step(plan)
    resumed.load(tmp_path)
    assert _train(resumed, 3, 5) == _train(saving, 3, 5)
    ours, theirs = resumed.full_state_dict(), saving.full_state_dict()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_delayed_updates_lag_a_step():
    """The second step computes on the initial weights (its loss is the initial model's on its
    batch); the updates still reach every weight, on another trajectory than the plain run's."""
    plain, delayed, initial = (_step(_plan(mode)) for mode in ("none", "delayed", "none"))
    second = _train(delayed, 0, 2)[1]
    assert second == float(initial(*_gpt_batch(1, 0), torch.tensor(1.0)))
    initial = _step(_plan("none")).full_state_dict()
    _train(plain, 0, 2)
    plain_weights, delayed_weights = plain.full_state_dict(), delayed.full_state_dict()
    assert any(not torch.equal(plain_weights[k], delayed_weights[k]) for k in plain_weights)
    assert all(not torch.equal(initial[k], delayed_weights[k]) for k in initial)


PIPELINED = {"optimizer": "cpu", "defer_updates": "next_forward"}


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"grad_accumulation": 2, "offload": PIPELINED}, "grad_accumulation: 1"),
        (
            {"offload": {**PIPELINED, "optimizer": "nvme", "nvme_path": "/tmp"}},
            "offload.optimizer: cpu",
        ),
        ({"offload": {"params": "cpu", "defer_updates": "delayed"}}, "offload.optimizer: cpu"),
        (
            {"offload": {"optimizer": "cpu", "params": "cpu", "defer_updates": "delayed"}},
            "a compute copy apart from the weights the update writes",
        ),
    ],
)
def test_a_pipeline_the_plan_cannot_hold_is_a_plan_error(plan, message):
    with pytest.raises(PlanError, match=message):
        zerocc.load_plan({"zero": {"stage": 3}, **plan})


def test_yaml_off_names_the_allowed_values():
    with pytest.raises(PlanError, match="'none', 'next_forward', 'delayed'"):
        zerocc.load_plan(
            {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "defer_updates": False}}
        )


def test_a_failing_host_update_raises_at_its_wait_and_settle_waits_out_the_rest():
    worker = HostWorker(threaded=True)
    ran: list[int] = []

    def fails() -> None:
        raise ValueError("no room")

    work = worker.submit(fails)
    later = worker.submit(lambda: ran.append(1))
    with pytest.raises(ValueError, match="no room"):
        work.wait()
    worker.settle()
    later.wait()
    assert ran == [1]  # issued before the failure was seen: it ran, and settle waited for it


@pytest.mark.parametrize("stage", [2, 3])
def test_inductor_issues_the_carried_updates_from_its_one_graph(threaded, stage):
    """The whole program compiled by Inductor, its carried updates issued to the host's worker
    from the generated code: fp32 losses and weights within 1e-5 of the eager backend's (the
    Inductor parity tests' tolerance: it fuses and reorders reductions). Under stage 2 the
    copy writes the weights the graph reads, which orders it before their reads."""
    # AdamW's eps of 1e-3, as in tests/parity: with 1e-8 an element whose tiny gradient
    # Inductor rounds to another sign moves by ±lr, whatever the rounding's size.
    optimizer = {**ADAMW, "eps": 1e-3}
    plan = {**_plan("next_forward", optimizer, stage=stage), "precision": FP32}
    runs = {b: _step({**plan, "backend": {"name": b}}) for b in ("eager", "inductor-whole")}
    losses = {b: _train(step, 0, 4) for b, step in runs.items()}
    assert losses["inductor-whole"] == pytest.approx(losses["eager"], rel=1e-5)
    notes = runs["inductor-whole"].record().backend_notes
    assert notes[0].startswith("inductor: the whole program compiled as one graph"), notes
    ours, theirs = (runs[b].full_state_dict() for b in ("inductor-whole", "eager"))
    for name, value in theirs.items():  # ‖a − b‖ / ‖b‖, as tests/parity measures weights
        assert float((ours[name] - value).norm() / value.norm()) <= 1e-5, name
