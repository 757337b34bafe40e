"""Graph-level tests of the precision pass, and bytes counted at the collectives, on a fake
process group (no ranks)."""

from __future__ import annotations

import pytest
import torch
from models import tiny_gpt
from parity import batch_of

import zerocc
from zerocc.errors import PassOrderError
from zerocc.inspect.explain import held_gradient_bytes
from zerocc.ir.nodes import (
    FOUND_INF,
    MASTER,
    PARAM_FULL,
    PARAM_SHARD,
    info,
    op_name,
    placeholders,
    val,
)

WORLD = 4


def compiled(stage: int, precision: dict, world: int = WORLD, calls: int = 1, accum: int = 1):
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": {"grad_clip": 1.0},
        "precision": precision,
        "grad_accumulation": accum,
    }
    step = zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(world))
    for i in range(calls):
        step(*batch_of({"model": "gpt"}, i, 0))
    return step


def nodes(step, name: str):
    return [n for n in step.program.graph.nodes if op_name(n.target) == name]


def moved(step) -> dict[str, int]:
    """Bytes per collective kind of the last step, counted where each collective is issued."""
    return dict(step.comm.stats.bytes)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_are_used_in_the_compute_dtype_without_per_use_casts(stage):
    step = compiled(stage, {"param": "bf16"})
    weights = placeholders(step.program, PARAM_SHARD if stage == 3 else PARAM_FULL)
    assert weights and all(val(n).dtype == torch.bfloat16 for n in weights)
    masters = placeholders(step.program, MASTER)
    assert len(masters) == len(step.units)
    assert all(val(n).dtype == torch.float32 for n in masters)
    # Capture cast every parameter at use and every gradient back to fp32; no cast of either
    # survives: parameters are read from the bf16 copy, gradients packed from bf16.
    casts = [n for n in nodes(step, "aten._to_copy") if info(n).phase != "forward"]
    assert not [n for n in casts if val(n.args[0]).dtype == torch.bfloat16], casts
    updates = nodes(step, "zerocc.adamw_")
    assert all(n.args[0] in masters and n.args[7] is not None for n in updates)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_reduces_each_gradient_where_fp32_does(stage):
    """Each unit's gradient is reduced as soon as backward completes it, beside the backward
    of the units before it, in bf16 as in fp32. Autograd casts the gradients up to fp32 last
    (capture casts every parameter as the step begins); left there, every reduction followed
    backward and none overlapped it."""

    def backward_matmuls_after_each_reduction(step) -> list[int]:
        counts, matmuls = [], 0
        for node in reversed(step.program.graph.nodes):
            name = op_name(node.target)
            if name == "aten.mm" and info(node).phase == "backward":
                matmuls += 1
            elif name in ("zerocc.reduce_scatter_start", "zerocc.all_reduce_start"):
                counts += [matmuls] if info(node).unit is not None else []  # not the norm's
        return counts[::-1]

    fp32 = backward_matmuls_after_each_reduction(compiled(stage, {}))
    bf16 = backward_matmuls_after_each_reduction(compiled(stage, {"param": "bf16"}))
    assert len(fp32) == len(compiled(stage, {}).units) and sum(fp32) > 0, fp32
    assert bf16 == fp32


def test_stage3_gathers_move_half_the_bytes_of_fp32():
    fp32, bf16 = compiled(3, {}), compiled(3, {"param": "bf16"})
    assert moved(bf16)["all_gather"] * 2 == moved(fp32)["all_gather"]
    gathered = [val(n.args[0]).dtype for n in nodes(bf16, "zerocc.all_gather_start")]
    assert set(gathered) == {torch.bfloat16}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("reduce", "itemsize"), [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_reduce_scatter_bytes_follow_the_reduce_dtype(stage, reduce, itemsize):
    step = compiled(stage, {"param": "bf16", "reduce": reduce})
    psi = sum(u.padded_numel for u in step.units)
    assert moved(step)["reduce_scatter"] == psi * itemsize
    reduced = {val(n.args[0]).dtype for n in nodes(step, "zerocc.reduce_scatter_start")}
    assert reduced == {
        zerocc.load_plan({"precision": {"reduce": reduce}}).precision.dtype("reduce")
    }


def test_stage0_all_reduces_in_the_reduce_dtype():
    fp32, bf16 = compiled(0, {"param": "bf16"}), compiled(0, {"param": "bf16", "reduce": "bf16"})
    assert moved(bf16)["all_reduce"] * 2 == moved(fp32)["all_reduce"]


def test_explain_counts_the_same_bytes_as_the_collectives():
    step = compiled(3, {"param": "bf16", "reduce": "bf16"})
    figures = zerocc.inspect.explain.describe(step.record())
    assert figures["comm_bytes_per_step"]["all_gather"] == moved(step)["all_gather"]
    assert figures["comm_bytes_per_step"]["reduce_scatter"] == moved(step)["reduce_scatter"]
    # Measured counts the step counter, lr and the loss scale too (24 bytes the formula ignores).
    assert figures["model_state_bytes"] == pytest.approx(figures["formula_bytes"], rel=1e-3)
    psi = sum(u.padded_numel for u in step.units)
    # Over 4 ranks: 2 param + 12 optimizer bytes per parameter. At grad_accumulation 1 no
    # gradient is state: the updates read the bf16 reduced shards (2 bytes), held in the step.
    assert figures["formula_bytes"]["total"] == pytest.approx(psi * (2 + 12) / WORLD)
    assert held_gradient_bytes(step.program) == psi * 2 // WORLD
    assert "compute bf16, reduce bf16, master fp32, grads fp32" in step.explain()


BF16_GRADS = {"param": "bf16", "reduce": "bf16", "grad": "bf16"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_give_zeros_bytes_per_parameter(stage):
    """ZeRO's mixed-precision Adam with bf16 gradients, accumulated over micro-batches (so they
    are state): params 2, grads 2, optimizer 12 bytes per parameter, each sharded from its
    stage on, 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N: measured, and explain's formula."""
    step = compiled(stage, BF16_GRADS, accum=2, calls=2)
    figures = zerocc.inspect.explain.describe(step.record())
    psi, n = sum(u.padded_numel for u in step.units), WORLD
    expected = {
        "params": 2 * psi // (n if stage == 3 else 1),
        "grads": 2 * psi // (n if stage >= 2 else 1),
        "optimizer": 12 * psi // (n if stage >= 1 else 1),
    }
    measured = dict(figures["model_state_bytes"])
    measured["optimizer"] -= 16  # AdamW's step counter and the lr
    for category, nbytes in expected.items():
        assert figures["formula_bytes"][category] == nbytes, category
        assert measured[category] == nbytes, category
    zero = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    assert figures["formula_bytes"]["total"] == zero[stage]
    assert "grads bf16" in step.explain()


def test_grad_dtype_leaves_the_full_accumulators_of_stages_0_1_in_reduce():
    """Stages 0-1 keep the full gradient in `reduce` (the buffer their collective reduces in
    place); precision.grad is the dtype of stage 2-3's gradient shards."""
    step = compiled(1, {**BF16_GRADS, "reduce": "fp32"}, accum=2)
    assert {t.dtype for k, t in step.state.items() if k.endswith(".grad")} == {torch.float32}
    step = compiled(2, {**BF16_GRADS, "reduce": "fp32"}, accum=2)
    assert {t.dtype for k, t in step.state.items() if k.endswith(".grad")} == {torch.bfloat16}


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_unscales_checks_and_passes_the_flag_to_every_update(stage):
    step = compiled(stage, {"param": "fp16"})
    (check,) = nodes(step, "zerocc.unscale_check_")
    (flag,) = [n for n in step.program.graph.nodes if info(n).role == FOUND_INF]
    # Sharded gradients: each rank checked its slice, so the flag is all-reduced.
    assert (flag is check) == (stage == 0)
    assert all(n.args[6] is flag for n in nodes(step, "zerocc.adamw_"))
    output = next(n for n in step.program.graph.nodes if n.op == "output")
    assert output.args[0][1] is flag
    assert step.loss_scale is not None and "loss scale" in step.explain()


def test_precision_after_optimizer_is_an_order_error():
    plan = {"precision": {"param": "bf16"}, "passes": ["partition", "shard", "optimizer"]}
    plan["passes"].append("precision")
    with pytest.raises(PassOrderError, match="'precision' must run before 'optimizer'"):
        zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(2))
