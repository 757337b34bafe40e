"""Parity of every elementwise optimizer the plan names against the same torch.optim optimizer
(Lion against the paper's, tests/parity/lion.py) in one process on all ranks' batches (fp32).

Tolerance 1e-5 relative, as tests/parity/test_parity.py's (the same sums of rank gradients in
another order, a few ulps per step); the optimizers that divide by a gradient's scale take
eps=1e-3 as its AdamW does: the GPT's key biases have noise-level gradients (the softmax does
not see them), which an eps of 1e-8 turns into steps of lr whose direction is the noise's
(centered RMSprop at 4 ranks: 1.1e-4 on c_attn.bias). Each optimizer trains the GPT at ZeRO-3 on
2 ranks in the default run, with the fields that give it another state or branch set (AMSGrad,
centered RMSprop with momentum, SGD's dampening and Nesterov, Adagrad's decay and initial value,
NAdam's and RAdam's decoupled decay), and one at 4 ranks; stages 0-2 are slow (``pytest
--slow``). Beside them: offload to the host (and a host update carried into the next step), a
cosine schedule, and (slow) AMSGrad's three states on NVMe and the Inductor backend, which runs
the update as an opaque op.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from multirank import run_ranks

from parity import assert_matches_reference, case_id, is_slow, of_speed, run_once, sweep, train

TOL = 1e-5

# Each optimizer's fields in these tests (lr, and what gives it another state or branch).
OPTIMIZERS = {
    "adam": {"name": "adam", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01, "amsgrad": True},
    "sgd-dampening": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.1,
                      "weight_decay": 0.01},
    "sgd-nesterov": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    "adagrad": {"name": "adagrad", "lr": 5e-2, "lr_decay": 0.01, "weight_decay": 0.01,
                "initial_accumulator_value": 0.1},
    "rmsprop": {"name": "rmsprop", "lr": 1e-3, "eps": 1e-3, "momentum": 0.5, "centered": True,
                "weight_decay": 0.01},
    "nadam": {"name": "nadam", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01,
              "decoupled_weight_decay": True},
    "radam": {"name": "radam", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01},
    "adamax": {"name": "adamax", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01},
    "lion": {"name": "lion", "lr": 1e-3, "weight_decay": 0.1},
}  # fmt: skip
NVME = Path(tempfile.gettempdir()) / "zerocc-test-nvme"
NVME.mkdir(exist_ok=True)
COSINE = {"schedule": {"name": "cosine", "warmup_steps": 2, "total_steps": 5}}


def _cases() -> list[dict]:
    cases = [
        {"model": "gpt", "stage": stage, "world": 2, "optimizer": optimizer,
         "slow": stage != 3}
        for optimizer in OPTIMIZERS.values()
        for stage in range(4)
    ]  # fmt: skip
    # 4 ranks, with gradient accumulation and clipping: Adagrad at stage 2 (slow: the others)
    four = {"model": "gpt", "world": 4, "accum": 2}
    clipped = {"grad_clip": 0.05}
    cases.append({**four, "stage": 2, "optimizer": {**OPTIMIZERS["adagrad"], **clipped}})
    cases += [
        {**four, "stage": 3, "optimizer": {**optimizer, **clipped}, "slow": True}
        for name, optimizer in OPTIMIZERS.items()
        if name != "adagrad"
    ]
    # Offload (the update on the host, its states there), a carried host update (the step
    # count and lr the runtime sets for it), a schedule and the whole-graph Inductor backend.
    cases += [
        {"model": "gpt", "stage": 3, "world": 2, "offload": {"optimizer": "cpu"},
         "optimizer": {**OPTIMIZERS["rmsprop"], **clipped}},
        {"model": "gpt", "stage": 3, "world": 2, "optimizer": OPTIMIZERS["nadam"],
         "offload": {"optimizer": "cpu", "defer_updates": "next_forward"}},
        {"model": "gpt", "stage": 2, "world": 2, "optimizer": {**OPTIMIZERS["radam"], **COSINE}},
        {"model": "gpt", "stage": 2, "world": 2, "offload": {"optimizer": "cpu"},
         "optimizer": OPTIMIZERS["lion"], "slow": True},
        {"model": "gpt", "stage": 3, "world": 2, "optimizer": OPTIMIZERS["adam"], "slow": True,
         "offload": {"optimizer": "nvme", "nvme_path": str(NVME), "params": "nvme"}},
        {"model": "gpt", "stage": 3, "world": 2, "steps": 3, "backend": "inductor",
         "optimizer": OPTIMIZERS["adagrad"], "slow": True},
    ]  # fmt: skip
    return cases


CASES = _cases()


@run_once
def _results(world: int, slow: bool) -> list[dict]:
    return run_ranks(world, train, of_speed([c for c in CASES if c["world"] == world], slow))


@pytest.mark.parametrize("case", sweep(CASES), ids=case_id)
def test_matches_torch_optim(case):
    assert_matches_reference(_results(case["world"], is_slow(case)), case, TOL)
