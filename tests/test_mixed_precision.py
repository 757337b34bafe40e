"""Mixed precision on gloo ranks beyond parity with the recipe (tests/parity/
test_mixed_precision_parity.py): the plan's dtype rules, an overflow on one rank, a bf16 loss
curve and pure bf16 against the recipe written by hand."""

from __future__ import annotations

import pytest
import torch
from models import MODELS, build
from multirank import run_ranks

import zerocc
from zerocc.errors import PlanError


def test_grad_dtype_is_fp32_or_the_compute_dtype():
    """precision.grad: fp32 or param's dtype; another 16-bit dtype is a plan error naming both
    (a narrower grad than reduce is allowed: the sum is reduced wide, rounded once)."""
    plan = zerocc.load_plan({"precision": {"param": "bf16", "grad": "bf16"}})
    assert plan.precision.dtype("grad") == torch.bfloat16 and plan.precision.reduce == "fp32"
    assert zerocc.load_plan({"precision": {"param": "bf16"}}).precision.dtype("grad") == (
        torch.float32
    )
    with pytest.raises(PlanError, match="precision: grad 'fp16' with param 'bf16'.*65504"):
        zerocc.load_plan({"precision": {"param": "bf16", "grad": "fp16"}})
    with pytest.raises(PlanError, match="grad 'bf16' with param 'fp32'.*use grad: fp32"):
        zerocc.load_plan({"precision": {"grad": "bf16"}})


# --- overflow on one rank ----------------------------------------------------------------------


OVERFLOW_AT = 2
SCALES = [1024, 1024, 512, 512, 512, 1024, 1024]  # after each step: halved, grown back


def _overflow_run(rank: int, world: int) -> list[dict]:
    plan = {
        "zero": {"stage": 3},
        "units": MODELS["buffers"][2],
        "optimizer": {"lr": 1e-2, "eps": 1e-3},
        "precision": {
            "param": "fp16",
            "dynamic": {"initial": 1024, "growth_interval": 3, "hysteresis": 1},
        },
        "backend": {"device": "cpu"},
    }
    step = zerocc.compile(build("buffers"), plan)
    record = []
    for i in range(len(SCALES)):
        x, y = MODELS["buffers"][1](i, rank)
        if i == OVERFLOW_AT and rank == 1:
            x[0, 0] = float("inf")  # this rank's gradient overflows
        before = {k: t.clone() for k, t in step.state.items() if not k.endswith(".grad")}
        step(x, y)
        record.append(
            {
                "unchanged": [k for k, t in before.items() if torch.equal(t, step.state[k])],
                "changed": [k for k, t in before.items() if not torch.equal(t, step.state[k])],
                "scale": step.loss_scale,
                "skipped": step.skipped_steps,
                "steps": step.steps,
            }
        )
    return record


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    ranks = run_ranks(2, _overflow_run)
    for rank, record in enumerate(ranks):
        assert [r["scale"] for r in record] == SCALES, rank
        skipped = record[OVERFLOW_AT]
        # Every master weight, compute copy, optimizer state and the step counter: bit-identical.
        assert not [k for k in skipped["changed"] if k != "amp.loss_scale"], skipped["changed"]
        assert any(k.endswith(".master") for k in skipped["unchanged"])
        assert any(k.endswith(".exp_avg_sq") for k in skipped["unchanged"])
        assert skipped["skipped"] == 1 and skipped["steps"] == OVERFLOW_AT
        # The steps around it do update (the check above could fail).
        for normal in (record[OVERFLOW_AT - 1], record[OVERFLOW_AT + 1]):
            assert any(k.endswith(".master") for k in normal["changed"])
        assert record[-1]["steps"] == len(SCALES) - 1


# --- a bf16 loss curve -------------------------------------------------------------------------


def _curve(precision: dict, steps: int = 50) -> list[float]:
    from workload import workload

    work = workload(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4)
    plan = {
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "optimizer": {"lr": 3e-3, "grad_clip": 1.0},
        "precision": precision,
    }
    step = zerocc.compile(work.model, plan)
    batches = work.batches(0, 1)
    return [float(step(*next(batches))) for _ in range(steps)]


def test_bf16_gpt_follows_the_fp32_loss_curve():
    fp32, bf16 = _curve({}), _curve({"param": "bf16"})
    # An untrained model sits at ln(vocab) ≈ 4.1; fifty steps reach ≈ 3.0 (character unigrams).
    assert sum(fp32[-10:]) < 0.9 * sum(fp32[:10]), "the fp32 run does not train"

    def smooth(xs, i):
        return sum(xs[i - 5 : i]) / 5

    for i in range(5, 51):
        assert smooth(bf16, i) == pytest.approx(smooth(fp32, i), rel=0.03), i


def _pure_bf16_reference(steps: int, lr: float, eps: float, wd: float) -> list[float]:
    """Pure bf16 by hand: weights and AdamW moments stored in bf16; each update's arithmetic in
    fp32 on them (torch.optim's formula), rounded once when stored."""
    torch.manual_seed(0)
    model = build("gpt").to(torch.bfloat16)
    params = list(model.parameters())
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    losses = []
    for t in range(1, steps + 1):
        loss = model(*_bf16_batch(t)).float()
        losses.append(float(loss.detach()))
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, (m, v), g in zip(params, moments, grads, strict=True):
                p32, m32, v32, g32 = p.float(), m.float(), v.float(), g.float()
                p32.mul_(1 - lr * wd)
                m32.lerp_(g32, 0.1)
                v32.mul_(0.999).addcmul_(g32, g32, value=0.001)
                denom = (v32.sqrt() / (1 - 0.999**t) ** 0.5).add_(eps)
                p32.addcdiv_(m32, denom, value=-lr / (1 - 0.9**t))
                p.copy_(p32), m.copy_(m32), v.copy_(v32)
    return losses


def _bf16_batch(t: int) -> tuple[torch.Tensor, ...]:
    from parity import batch_of

    return batch_of({"model": "gpt"}, t, 0)


@pytest.mark.parametrize("stage", [0, 3])
def test_pure_bf16_trains_as_the_recipe_by_hand(stage):
    """precision.master: bf16 (weights and moments in bf16) trains, instead of failing in the
    update; one process, so the losses are bit-identical to the recipe written by hand."""
    lr, eps, wd = 1e-2, 1e-3, 0.01
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": {"lr": lr, "eps": eps, "weight_decay": wd},
        "precision": {"param": "bf16", "master": "bf16"},
    }
    torch.manual_seed(0)
    step = zerocc.compile(build("gpt"), plan)
    losses = [float(step(*_bf16_batch(t))) for t in range(1, 5)]
    assert losses == _pure_bf16_reference(4, lr, eps, wd)
