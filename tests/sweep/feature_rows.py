"""Training a covering array's row (tests/sweep/feature_cells.py) on its ranks, and the oracle
it is held to: tests/parity/__init__.py's, one process training on all ranks' batches.

A rank trains the row's plan for its steps as the harness's ``train`` does (a pipeline as
test_pipeline_parity.py's); where the row turns them on it also evaluates
(``metrics.eval_every``: ``TrainStep.evaluate`` on the batch its next step trains on, before
it, from the second step: a pipeline is cut on its first) and saves in the background after
its first step (``checkpoint.async_save``: ``save_async``, waited for at the end).
``checkpoint.in_memory`` takes effect under ``zerocc train``'s launcher only: its rows hold
that the field changes nothing else. A rank's error is returned,
not raised, so that the test says which row failed and how.

Tolerances, the parity files' for their reasons: fp32 1e-5 (tests/parity/test_parity.py),
16-bit compute 1e-2 (test_mixed_precision_parity.py), raised under Inductor by the harness.
A row that quantizes a collective (``zero.quantized_weights`` / ``quantized_grads``) has no
unrounded oracle: its first step's losses are held to tests/engine/test_quantized.py's
first-step tolerance, 1e-3 (the rounding alone; the 16-bit one where larger), the next step's
to its curve tolerance, 5e-2 (weights updated from rounded values part as any two runs'), and
its weights to finite values. A row with
``precision.matmul: fp8`` is compared with the reference model converted by the same layers
(tests/test_float8.py's oracle: torchao's float8 layers in one process). Its fp32 gradients
are summed in the order the row's ranks sum them where that order is known (ZeRO stages 0-1:
each rank's micro-batches first, then the ranks'), since float8 magnifies the last bits of a
sum: another association of the same sum leaves a step's weights a few ulps apart, the next
step's float8 casts (2 or 3 bits of mantissa) round a few elements the other way, and that
step's gradients lie percents apart. Measured on the GPT of 4 blocks, 2 data ranks × 2
micro-batches, summed micro-batch by micro-batch against rank by rank in one process: 8e-8
after the first step, 3.1e-2 after the second, 5.65e-4 in the weights; the pipeline's ranks
(every schedule) and one process summing as they do agree within 1e-7.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import parity
import torch
from feature_cells import case_key, plan_dict
from parity import assert_matches_reference, batch_of

import zerocc

TOL_FP32 = 1e-5
TOL_LOW = 1e-2
TOL_QUANTIZED = 1e-3
TOL_QUANTIZED_CURVE = 5e-2


def tolerance(case: dict[str, Any]) -> float:
    """The row's parity tolerance (before the harness raises it for a compiling backend)."""
    low = case.get("precision", {}).get("param") in ("bf16", "fp16")
    quantized = any(k.startswith("zero.quantized") for k in case["fields"])
    return max(TOL_LOW if low else TOL_FP32, TOL_QUANTIZED if quantized else 0.0)


def train_row(rank: int, world: int, case: dict[str, Any], folder: str) -> dict[str, Any]:
    """The row's training on this rank: the harness's results under its key, or its error."""
    try:
        return _train(rank, case, folder)
    except Exception as exc:  # noqa: BLE001  (said by the test, with the rank)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _train(rank: int, case: dict[str, Any], folder: str) -> dict[str, Any]:
    """A row on this rank, as tests/parity's ``train`` (a pipeline's: as
    test_pipeline_parity.py's, each step's batch the data rank's micro-batches joined)."""
    fields = case["fields"]
    step = zerocc.compile(parity._model(case, rank), plan_dict(case, folder))
    k, pipeline = case.get("accum", 1), "pp" in case
    losses, evaluated, saved = [], [], None
    for s in range(case["steps"]):
        micro = [batch_of(case, s * k + m, step.data_rank) for m in range(k)]
        batches = (
            [tuple(torch.cat(parts) for parts in zip(*micro, strict=True))] if pipeline else micro
        )
        if fields.get("metrics.eval_every") and s > 0:  # (a pipeline is cut on its first)
            evaluated.append(float(step.evaluate(*batches[0])))
        losses += [float(step(*batch)) for batch in batches]
        if fields.get("checkpoint.async_save") and s == 0:
            step.save_async(folder)
    if fields.get("checkpoint.async_save"):
        saved = step.wait_for_save()
    params = step.full_state_dict()  # collective: every rank calls it
    return {
        case_key(case): {"losses": losses, "params": params if rank == 0 or pipeline else None},
        "data_rank": step.data_rank,
        "evaluated": evaluated,
        "saved": str(saved) if saved is not None else None,
    }


def run_row(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The row trained on its ranks (results by rank)."""
    from multirank import run_ranks

    with tempfile.TemporaryDirectory(prefix="zerocc-sweep-") as folder:
        ranks = run_ranks(case["world"], train_row, case, folder, timeout=900)
        for result in ranks:  # (the folder goes with this call: say what was there)
            if result.get("saved"):
                result["saved_files"] = sorted(p.name for p in Path(result["saved"]).iterdir())
    return ranks


def _converted(case: dict[str, Any]):
    """The reference's model, its float8 layers converted as the row's plan converts them."""
    from zerocc.compiler.float8 import Float8Layers
    from zerocc.compiler.plan import load_plan

    build = parity._model

    def model(c: dict[str, Any], rank: int = 0) -> torch.nn.Module:
        built = build(c, rank)
        Float8Layers.convert(built, load_plan(plan_dict(case)))
        return built

    return mock.patch.object(parity, "_model", model)


def _summed_as_the_ranks_sum(case: dict[str, Any]) -> contextlib.AbstractContextManager:
    """The reference's gradient summed as a step at ZeRO stage 0 or 1 sums it: each data
    rank's micro-batches accumulated apart, then the ranks' sums added (each rank accumulates
    its micro-batches in its full gradient and reduces it on the micro-batch that steps:
    zerocc/compiler/passes/support/gradients.py), where the harness adds micro-batch by
    micro-batch over the ranks into one gradient. At stages 2-3 (a reduce-scatter every
    micro-batch) the harness's order stays."""
    if case["stage"] > 1:
        return contextlib.nullcontext()

    def backward_step(
        case: dict[str, Any], model: torch.nn.Module, s: int, losses: list[list[float]]
    ) -> None:
        world, k = parity.data_ranks(case), case.get("accum", 1)
        params = [p for p in model.parameters() if p.requires_grad]
        summed: list[torch.Tensor | None] = [None] * len(params)
        for r in range(world):
            for p in params:
                p.grad = None
            for micro in range(k):
                batch = parity._on_device(case, batch_of(case, s * k + micro, r))
                keyed = case.get("keyed")
                with zerocc.keyed_draws(parity.SEED, s, r * k + micro) if keyed else _NONE:
                    loss = parity.loss_of(model(*batch))
                losses[r].append(float(loss.detach()))
                (loss / (world * k)).backward()
            for i, p in enumerate(params):
                if p.grad is not None:
                    summed[i] = p.grad if summed[i] is None else summed[i] + p.grad
        for p, grad in zip(params, summed, strict=True):
            p.grad = grad

    return mock.patch.object(parity, "_backward_step", backward_step)


_NONE = contextlib.nullcontext()


def assert_row_trained_alike(ranks: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """Every rank trained without error, as the oracle of the module's docstring."""
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}: {result['error']}\n{result['traceback']}"
    fields, tol = case["fields"], tolerance(case)
    fp8 = fields.get("precision.matmul") == "fp8"
    quantized = any(k.startswith("zero.quantized") for k in fields)
    with contextlib.ExitStack() as oracle:
        if fp8:
            oracle.enter_context(_converted(case))
            oracle.enter_context(_summed_as_the_ranks_sum(case))
        if "pp" in case or quantized:
            _assert_losses_and_weights(ranks, case, tol, weights=not quantized)
        else:
            assert_matches_reference(ranks, case, tol)
    if fields.get("metrics.eval_every"):
        _assert_evaluated(ranks, case, tol)
    if fields.get("checkpoint.async_save"):
        step = ranks[0]["saved"]
        assert step is not None and int(Path(step).name.split("-")[1]) == 1, step
        assert ranks[0]["saved_files"], "the background save wrote nothing"


def _assert_losses_and_weights(
    ranks: list[dict[str, Any]], case: dict[str, Any], tol: float, weights: bool
) -> None:
    """Each rank's losses within ``tol`` of the reference's for its data rank (a pipeline's: a
    step's mean over its micro-batches), and the weights the ranks hold (a pipeline rank: its
    stages') within ``tol`` by norm, or (``weights`` False) finite."""
    ref_losses, ref_state = parity.reference(case)
    key, k, loss_tol = case_key(case), case.get("accum", 1), parity.tolerance_of(case, tol)
    held: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        ours, mine = result[key]["losses"], ref_losses[result["data_rank"]]
        if "pp" in case:
            mine = [sum(mine[s * k : (s + 1) * k]) / k for s in range(case["steps"])]
        assert len(ours) == len(mine)
        first = len(ours) // case["steps"]  # (the first step's losses)
        for i, (a, b) in enumerate(zip(ours, mine, strict=True)):
            bound = loss_tol if weights or i < first else max(loss_tol, TOL_QUANTIZED_CURVE)
            assert abs(a - b) <= bound * abs(b), f"rank {rank} loss {i}: {a} vs {b}"
        held |= result[key]["params"] or {}
    if weights:
        assert set(held) <= set(ref_state)
        parity.assert_weights_alike(held, {n: ref_state[n] for n in held}, case, tol)
    for name, value in held.items():
        assert torch.isfinite(value).all(), name


def _assert_evaluated(ranks: list[dict[str, Any]], case: dict[str, Any], tol: float) -> None:
    """Each evaluated loss is the loss the next step trained with on the same batch (its
    first micro-batch; a pipeline's whole batch): the same weights, no dropout."""
    k = 1 if "pp" in case else case.get("accum", 1)
    key = case_key(case)
    for rank, result in enumerate(ranks):
        trained = result[key]["losses"][::k][1:]
        assert len(result["evaluated"]) == len(trained) == case["steps"] - 1
        for a, b in zip(result["evaluated"], trained, strict=True):
            assert math.isfinite(a) and abs(a - b) <= parity.tolerance_of(case, tol) * abs(b), (
                f"rank {rank}: evaluated {a}, trained {b}"
            )
