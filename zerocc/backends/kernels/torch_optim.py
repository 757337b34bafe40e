"""The updates of the plan's other optimizers (``zerocc.optim_update_``): torch's own functional
forms (``torch.optim.adagrad.adagrad``, ...) run on one flat shard as one tensor.

AdamW and plain SGD have kernels of their own, tuned per kernel set (:mod:`.reference`,
:mod:`.fused`, :mod:`.one_pass`, :mod:`.triton_kernels`); every other optimizer of the registry
(:mod:`zerocc.compiler.plan.optimizers`) runs here, whatever ``backend.kernels`` says: the
single-tensor path of torch's functional form, on the flat shard (every one of them is
elementwise, so the shard's update is the slice of the whole parameters' update). A new
torch.optim optimizer is one registry entry and one function below. Lion, not in torch.optim,
is its paper's formula.

The conventions are the kernel sets' (:mod:`.reference`): the gradient is scaled by
``grad_scale`` and the clip's ``grad_coef`` first, a ``found_inf`` step writes nothing but the
compute copy, arithmetic is fp32 (a bf16 master is widened and rounded once), and ``step`` is
the count of applied updates, this one included. States are zeros when first read, as torch
initializes them, except where the optimizer says otherwise on its first step (Adagrad's
``initial_accumulator_value``, SGD's buffer under dampening, NAdam's product of momenta, which
is a function of the step alone and computed here rather than kept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import adagrad, adam, adamax, nadam, radam, rmsprop, sgd

from zerocc.backends.kernels.reference import _copied, _effective_grad, _in_fp32, _skipped
from zerocc.compiler.plan.optimizers import OPTIMIZERS, hyper_of

# One optimizer's update of one fp32 flat tensor: (param, gradient (a temporary it may
# overwrite), its states by name, the step count, lr, its fields' values).
Update = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int, float, dict], None]
UPDATES: dict[str, Update] = {}


def update(name: str) -> Callable[[Update], Update]:
    """Decorator: ``fn`` is the update of the registry's optimizer ``name``."""

    def register(fn: Update) -> Update:
        if name in UPDATES:
            raise ValueError(f"the update of {name!r} is already registered")
        UPDATES[name] = fn
        return fn

    return register


def optim_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor | None],
    step: torch.Tensor | None,
    grad_coef: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    param_copy: torch.Tensor | None,
    grad_scale: float,
    lr: float,
    optimizer: str,
    hyper: list[float],
) -> None:
    """The registry's ``optimizer`` on one flat shard, with its fields' values ``hyper`` (as
    :func:`~zerocc.compiler.plan.optimizers.flat_hyper` carries them) and its states in the
    registry's order (None for those it does not keep)."""
    if _skipped(found_inf):
        return _copied(param, param_copy)
    kind = OPTIMIZERS[optimizer]
    values = hyper_of(kind, list(hyper))
    kept = [s for s in states if s is not None]
    names = kind.states_of(values)
    if len(names) != len(kept):
        raise RuntimeError(f"{optimizer} keeps {', '.join(names)}; the update got {len(kept)}")
    g = _effective_grad(grad, grad_scale, grad_coef)
    t = int(step.item()) if step is not None else 0
    with _in_fp32(param, *kept) as (p, *wide):
        UPDATES[optimizer](p, g, dict(zip(names, wide, strict=True)), t, lr, values)
    if param_copy is not None:
        param_copy.copy_(param)


def _steps(t: int) -> list[torch.Tensor]:
    """torch's step state before this step (its functional forms count it up themselves)."""
    return [torch.tensor(float(t - 1), dtype=torch.float32)]


@update("adam")
def _adam(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    amsgrad = bool(h["amsgrad"])
    adam.adam(
        [p], [g], [s["exp_avg"]], [s["exp_avg_sq"]], [s["max_exp_avg_sq"]] if amsgrad else [],
        _steps(t), foreach=False, amsgrad=amsgrad, beta1=h["betas"][0], beta2=h["betas"][1],
        lr=lr, weight_decay=h["weight_decay"], eps=h["eps"], maximize=False,
    )  # fmt: skip


@update("sgd")
def _sgd(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    # torch's first step stores the gradient itself in the buffer (no dampening): given none,
    # its functional form makes one, copied into the state.
    buffers: list[Any] = [s.get("momentum_buffer")]
    first = buffers[0] is not None and h["dampening"] and t == 1
    if first:
        buffers = [None]
    sgd.sgd(
        [p], [g], buffers, foreach=False, weight_decay=h["weight_decay"], momentum=h["momentum"],
        lr=lr, dampening=h["dampening"], nesterov=bool(h["nesterov"]), maximize=False,
    )  # fmt: skip
    if first:
        s["momentum_buffer"].copy_(buffers[0])


@update("adagrad")
def _adagrad(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    if t == 1 and h["initial_accumulator_value"]:
        s["sum"].fill_(h["initial_accumulator_value"])
    adagrad.adagrad(
        [p], [g], [s["sum"]], _steps(t), foreach=False, lr=lr, weight_decay=h["weight_decay"],
        lr_decay=h["lr_decay"], eps=h["eps"], maximize=False,
    )  # fmt: skip


@update("rmsprop")
def _rmsprop(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    rmsprop.rmsprop(
        [p], [g], [s["square_avg"]], [s["grad_avg"]] if "grad_avg" in s else [],
        [s["momentum_buffer"]] if "momentum_buffer" in s else [], _steps(t), foreach=False,
        lr=lr, alpha=h["alpha"], eps=h["eps"], weight_decay=h["weight_decay"],
        momentum=h["momentum"], centered=bool(h["centered"]),
    )  # fmt: skip


# NAdam's product of momenta after t steps, by (beta1, momentum_decay): a function of the step
# alone, computed as torch's optimizer multiplies it up (an fp32 0-dim tensor, once per step),
# so it is neither kept nor saved; extended from the last step asked (each step asks the next).
_MU_PRODUCTS: dict[tuple[float, float], tuple[int, torch.Tensor]] = {}


def _mu_product(t: int, beta1: float, momentum_decay: float) -> torch.Tensor:
    """NAdam's ``mu_product`` state after ``t`` steps."""
    known, product = _MU_PRODUCTS.get((beta1, momentum_decay), (0, None))
    if product is None or known > t:
        known, product = 0, torch.ones((), dtype=torch.float32)
    product = product.clone()
    for step in range(known + 1, t + 1):
        product *= beta1 * (1.0 - 0.5 * (0.96 ** (float(step) * momentum_decay)))
    _MU_PRODUCTS[(beta1, momentum_decay)] = (t, product)
    return product.clone()


@update("nadam")
def _nadam(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    beta1, beta2 = h["betas"]
    nadam.nadam(
        [p], [g], [s["exp_avg"]], [s["exp_avg_sq"]],
        [_mu_product(t - 1, beta1, h["momentum_decay"])], _steps(t),
        decoupled_weight_decay=bool(h["decoupled_weight_decay"]), foreach=False, beta1=beta1,
        beta2=beta2, lr=lr, weight_decay=h["weight_decay"], momentum_decay=h["momentum_decay"],
        eps=h["eps"],
    )  # fmt: skip


@update("radam")
def _radam(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    radam.radam(
        [p], [g], [s["exp_avg"]], [s["exp_avg_sq"]], _steps(t),
        decoupled_weight_decay=bool(h["decoupled_weight_decay"]), foreach=False,
        beta1=h["betas"][0], beta2=h["betas"][1], lr=lr, weight_decay=h["weight_decay"],
        eps=h["eps"],
    )  # fmt: skip


@update("adamax")
def _adamax(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    adamax.adamax(
        [p], [g], [s["exp_avg"]], [s["exp_inf"]], _steps(t), foreach=False, eps=h["eps"],
        beta1=h["betas"][0], beta2=h["betas"][1], lr=lr, weight_decay=h["weight_decay"],
    )  # fmt: skip


@update("lion")
def lion(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, lr: float, h: dict) -> None:
    """Lion (Chen et al. 2023, Algorithm 2): the sign of an interpolation of the momentum and
    the gradient, decoupled weight decay, then the momentum's update with beta2."""
    beta1, beta2 = h["betas"]
    m = s["exp_avg"]
    direction = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
    p.mul_(1 - lr * h["weight_decay"]).add_(direction, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)
