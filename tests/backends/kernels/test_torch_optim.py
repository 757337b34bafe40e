"""The other optimizers' update (zerocc.backends.kernels.torch_optim) against torch.optim's
classes on one tensor: bit for bit over several steps (the same single-tensor arithmetic, the
states torch keeps computed or kept alike), with the kernel sets' conventions: the gradient
scaled and clipped first, a found_inf step writing only the compute copy, a bf16 master's
arithmetic in fp32."""

from __future__ import annotations

import pytest
import torch
from parity import OPTIMIZER_CLASSES

from zerocc.backends.kernels.torch_optim import UPDATES, optim_update_
from zerocc.compiler.plan import load_plan
from zerocc.compiler.plan.optimizers import OPTIMIZERS, flat_hyper
from zerocc.compiler.state import optimizer_states

# Per optimizer, fields that reach each of its states and branches.
CONFIGS = [
    {"name": "adam", "weight_decay": 0.01},
    {"name": "adam", "amsgrad": True, "betas": [0.8, 0.9]},
    {"name": "sgd", "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
    {"name": "sgd", "momentum": 0.9, "nesterov": True},
    {"name": "adagrad", "lr_decay": 0.1, "initial_accumulator_value": 0.5, "weight_decay": 0.1},
    {"name": "rmsprop"},
    {"name": "rmsprop", "momentum": 0.5, "centered": True, "weight_decay": 0.01},
    {"name": "nadam", "weight_decay": 0.01},
    {"name": "nadam", "decoupled_weight_decay": True, "weight_decay": 0.01,
     "momentum_decay": 0.01},
    {"name": "radam", "weight_decay": 0.01},
    {"name": "radam", "decoupled_weight_decay": True, "weight_decay": 0.01},
    {"name": "adamax", "weight_decay": 0.01},
    {"name": "lion", "weight_decay": 0.1},
]  # fmt: skip
STEPS = 8  # RAdam rectifies from its 6th step on (rho_t > 5)
GRAD_SCALE, COEF = 0.25, 0.5


def _id(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


def _grads(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=gen) for _ in range(STEPS)]


def _zerocc(config: dict, param: torch.Tensor, grads: list[torch.Tensor], found=()) -> list:
    optimizer = load_plan({"optimizer": config}).optimizer
    names = optimizer_states(optimizer)
    states = [torch.zeros_like(param) for _ in names]
    hyper = flat_hyper(optimizer.kind, optimizer.hyper())
    copies, applied = [], 0
    for i, grad in enumerate(grads):
        skip = i in found
        applied += not skip
        copy = torch.empty_like(param, dtype=torch.bfloat16)
        optim_update_(
            param, grad, [*states, None, None, None][:3], torch.tensor(applied), torch.tensor(COEF),
            torch.tensor(float(skip)), copy, GRAD_SCALE, optimizer.lr, optimizer.name, hyper,
        )  # fmt: skip
        copies.append(copy)
    return [param, *states, copies]


def _torch(config: dict, param: torch.Tensor, grads: list[torch.Tensor]) -> list:
    optimizer = load_plan({"optimizer": config}).optimizer
    fields = {k: tuple(v) if k == "betas" else v for k, v in optimizer.hyper().items()}
    p = torch.nn.Parameter(param.clone())
    opt = OPTIMIZER_CLASSES[optimizer.name]([p], lr=optimizer.lr, **fields)
    for grad in grads:
        p.grad = grad * GRAD_SCALE * torch.tensor(COEF)
        opt.step()
    state = opt.state[p]
    return [p.detach(), *(state[name] for name in optimizer_states(optimizer))]


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_equals_torch_optim_bit_for_bit(config):
    param = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    grads = _grads(1000)
    *ours, copies = _zerocc(config, param.clone(), grads)
    theirs = _torch(config, param, grads)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(copies[-1], ours[0].to(torch.bfloat16))


def test_every_registered_elementwise_optimizer_has_an_update():
    elementwise = {n for n, k in OPTIMIZERS.items() if not k.whole_tensors}
    assert elementwise - {"adamw"} <= set(UPDATES)
    assert {c["name"] for c in CONFIGS} == elementwise - {"adamw"}


@pytest.mark.parametrize("config", [CONFIGS[4], CONFIGS[8], CONFIGS[-1]], ids=_id)
def test_a_found_inf_step_writes_only_the_compute_copy(config):
    """A skipped step (here the second) changes nothing, nor counts: the run equals torch's
    without that step's gradient, and the copy of the skipped step is the weights as they
    were."""
    param = torch.randn(100, generator=torch.Generator().manual_seed(0))
    grads = _grads(100)
    *ours, copies = _zerocc(config, param.clone(), grads, found={1})
    theirs = _torch(config, param, grads[:1] + grads[2:])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(copies[1], copies[0])


def test_a_bf16_master_computes_in_fp32_and_rounds_once():
    config = CONFIGS[7]
    param = torch.randn(100, generator=torch.Generator().manual_seed(0))
    grads = _grads(100)[:1]
    low = param.to(torch.bfloat16)
    *ours, _ = _zerocc(config, low.clone(), grads)
    theirs = _torch(config, low.float(), grads)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))
