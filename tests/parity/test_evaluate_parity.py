"""TrainStep.evaluate: the loss of a batch under the current weights, forward only.

The oracle is the step itself: the models here have no dropout, so the training program's
forward and the evaluation program compute the same loss from the same weights, and
``evaluate(batch)`` must equal, to the bit, the loss the next training micro-batch reports on
that batch (every stage, mixed precision and loss scaling, offload, recompute, in the middle of
an accumulation window). And evaluating changes nothing: a run that evaluates between its
steps trains exactly as one that does not.

Under a compiling backend (``pytest tests/parity --backend inductor``) the evaluation program
and the training program are compiled apart, to kernels of their own, so the evaluated loss is
held to the compiled tolerance of tests/parity/__init__.py (bit-identical as measured on torch
2.13, both forms: the forward's kernels came out the same); the training runs with and without
evaluating are one program, held to the bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import build, loss_of
from multirank import run_ranks

import zerocc
from parity import batch_of, case_id, plan_of, tolerance_of

CASES = [
    *({"model": "gpt", "stage": s, "world": 2} for s in range(4)),
    {"model": "gpt", "stage": 3, "world": 2, "precision": {"param": "bf16"}},
    {
        "model": "gpt",
        "stage": 2,
        "world": 2,
        "precision": {"param": "fp16"},  # dynamic loss scaling
    },
    {"model": "gpt", "stage": 3, "world": 2, "offload": {"optimizer": "cpu", "params": "cpu"}},
    # The update in flight applied first: under stage 2 its drain all-gathers on both ranks.
    {
        "model": "gpt",
        "stage": 2,
        "world": 2,
        "offload": {"optimizer": "cpu", "defer_updates": "next_forward"},
    },
    {"model": "gpt", "stage": 3, "world": 2, "recompute": {"units": "all"}},
    {"model": "buffers", "stage": 1, "world": 2, "accum": 2},
    # Expert parallelism: a forward-only program's exchanges keep nothing for a backward
    {"model": "mixtral_grouped", "stage": 3, "world": 2, "ep": 2},
]
STEPS = 4


def _train(rank: int, world: int, cases: list[dict]) -> dict:
    out = {}
    for case in cases:
        runs = {}
        for evaluating in (True, False):
            step = zerocc.compile(build(case["model"]), plan_of(case))
            losses, evaluated = [], []
            for i in range(STEPS * case.get("accum", 1)):
                batch = batch_of(case, i, rank)
                if evaluating and i % 2:  # (mid-window too, at accumulation 2)
                    evaluated.append(float(step.evaluate(*batch)))
                losses.append(float(step(*batch)))
            runs[evaluating] = {"losses": losses, "evaluated": evaluated}
        out[case_id(case)] = runs
    return out


@functools.cache
def _results() -> list[dict]:
    return run_ranks(2, _train, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_evaluate_is_the_next_steps_forward_and_changes_nothing(case):
    for rank, result in enumerate(_results()):
        runs = result[case_id(case)]
        odd = runs[True]["losses"][1::2]
        tol = tolerance_of(case, 0.0)  # 0: to the bit, under the eager backend
        pairs = zip(runs[True]["evaluated"], odd, strict=True)
        assert all(abs(a - b) <= tol * abs(b) for a, b in pairs), f"rank {rank}"
        assert runs[True]["losses"] == runs[False]["losses"], f"rank {rank}"


def _dropout_step(train: bool) -> tuple:
    """The dropout GPT (in train mode or not), its step on one rank, the eval-mode model's
    loss on the first batch, and that batch."""
    from models import RANDOM_MODELS

    build_dropout, make_batch, units = RANDOM_MODELS["gpt_dropout"]
    torch.manual_seed(0)
    model = build_dropout().train(train)
    reference = build_dropout()
    reference.load_state_dict(model.state_dict())
    reference.eval()
    plan = {"zero": {"stage": 3}, "units": units, "backend": {"kernels": "torch"}}
    step = zerocc.compile(model, plan, comm=zerocc.FakeComm(world_size=1))
    batch = make_batch(0, 0)
    with torch.no_grad():
        expected = float(loss_of(reference(*batch)))
    return model, step, expected, batch


def test_evaluate_runs_the_model_in_eval_mode():
    """Dropout off while evaluating (and back on for training): the loss is the eval-mode
    model's, the same batch evaluated twice gives the same loss."""
    model, step, expected, batch = _dropout_step(train=True)
    first, second = float(step.evaluate(*batch)), float(step.evaluate(*batch))
    assert first == second == pytest.approx(expected, rel=1e-6)
    assert model.training  # the user's model keeps its mode


def _materialized(rank: int, world: int, case: dict) -> dict:
    out = {}
    for materializing in (True, False):
        step = zerocc.compile(build(case["model"]), plan_of(case))
        losses = [float(step(*batch_of(case, i, rank))) for i in range(2)]
        if materializing:
            model = step.materialize_model()
            batch = batch_of(case, 9, rank)
            with torch.no_grad():
                out["model_loss"] = float(loss_of(model(*batch)))
            out["step_loss"] = float(step.evaluate(*batch))
            out["mask"] = model.mask.clone()
        losses += [float(step(*batch_of(case, i, rank))) for i in range(2, 4)]
        out[materializing] = losses
    return out


def test_materialize_model_gives_the_steps_weights_back():
    """At stage 3 on 2 ranks, with a non-persistent buffer: the user's model, materialized,
    computes the step's loss (a different reduction order than the evaluation program: 1e-6,
    or a compiling backend's tolerance), and training goes on as if it had not been called."""
    case = {"model": "buffers", "stage": 3, "world": 2}
    for rank, result in enumerate(run_ranks(2, _materialized, case)):
        tol = tolerance_of(case, 1e-6)
        assert result["model_loss"] == pytest.approx(result["step_loss"], rel=tol), rank
        assert torch.equal(result["mask"], build("buffers").mask), rank
        assert result[True] == result[False], rank


def test_training_is_traced_in_the_mode_the_user_left():
    """Evaluation traces in eval mode; a training program keeps the user's mode (a model put
    in eval mode trains without dropout: its first loss is the eval-mode model's)."""
    _, step, expected, batch = _dropout_step(train=False)
    assert float(step(*batch)) == pytest.approx(expected, rel=1e-6)
