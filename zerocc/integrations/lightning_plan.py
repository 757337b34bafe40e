"""A Lightning run read as a zerocc plan: the optimizer and learning-rate scheduler that
``configure_optimizers`` returns, the Trainer's gradient clipping, ``accumulate_grad_batches``
and precision become the plan's fields; what the plan cannot honour, or what disagrees with a
field the plan set itself, is refused by name (:class:`~zerocc.errors.PlanError` for a
conflict, :class:`~zerocc.errors.NotSupportedError` for a feature zerocc's step has not).

The rule for a field both sides can set is :mod:`zerocc.integrations.trainer_args`'s: where
the plan set it the values must agree, where it left it unset Lightning's is written in.

A scheduler is not translated by its class but by the rates it gives: it is stepped (then put
back) over the run's optimizer steps as Lightning would step it (its ``interval`` and
``frequency``), and the plan's schedule (``constant``, ``linear`` or ``cosine`` with a linear
warmup from 0) whose rates are the same is taken; a scheduler none expresses (a OneCycleLR's
cosine warmup from ``max_lr / div_factor``, a StepLR) is refused with the first step where
they part.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerocc.compiler.plan import OptimizerConfig, Plan, load_plan
from zerocc.compiler.schedule import lr_at
from zerocc.errors import NotSupportedError, PlanError

# The rates of a scheduler and of the plan's schedule are the same to this (relative): the
# plan's are computed as Hugging Face's LambdaLR multipliers compute them, a user's lambda may
# order its arithmetic otherwise.
RATE_TOLERANCE = 1e-9

# Lightning's precision settings and the plan's precision.param each stands for (its masters
# fp32, as under Lightning's autocast); any other precision plugin is refused by name.
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


@dataclass(frozen=True)
class LightningRun:
    """What the plan is read from: the module's one optimizer and its scheduler config (or
    None), the Trainer's clipping, accumulation and precision, and the run's length."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # lightning's LRSchedulerConfig, or None
    gradient_clip_val: float | None
    gradient_clip_algorithm: str | None
    accumulate_grad_batches: int
    precision: str
    total_steps: int  # optimizer steps the run takes
    steps_per_epoch: int  # optimizer steps an epoch takes


def _agree(plan_set: bool, field: str, plan_value: Any, source: str, value: Any) -> Any:
    """Lightning's value of a field the plan may have set: it must then be the plan's."""
    if plan_set and plan_value != value:
        raise PlanError(
            f"{source}={value!r} conflicts with the plan's {field}: {plan_value!r}; set one of "
            "them only, or the same value in both"
        )
    return value


def _optimizer_fields(run: LightningRun, base: Plan) -> dict[str, Any]:
    """The plan's optimizer section from the torch optimizer ``configure_optimizers`` made."""
    optimizer = run.optimizer
    kind = type(optimizer).__name__
    names = {torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}
    name = names.get(type(optimizer))
    if name is None:
        raise NotSupportedError(
            f"configure_optimizers returned torch.optim.{kind}; zerocc's step updates with "
            "torch.optim.AdamW or torch.optim.SGD (their hyperparameters become the plan's "
            "optimizer fields)"
        )
    groups = optimizer.param_groups
    first = {k: v for k, v in groups[0].items() if k != "params"}
    for index, group in enumerate(groups[1:], start=1):
        for key, value in group.items():
            if key != "params" and value != first.get(key):
                raise NotSupportedError(
                    f"configure_optimizers: param group {index} has {key}={value!r}, group 0 "
                    f"{first.get(key)!r}; zerocc's optimizer applies one set of "
                    "hyperparameters to every parameter: use one param group"
                )
    given = {id(p) for g in groups for p in g["params"]}
    left_out = [
        n for n, p in run.module.named_parameters() if p.requires_grad and id(p) not in given
    ]
    if left_out:
        raise NotSupportedError(
            f"configure_optimizers: {len(left_out)} trainable parameters ({left_out[0]}, ...) "
            f"are not in the {kind}; zerocc's step updates every parameter that requires grad: "
            "set requires_grad=False on those it should not train"
        )
    refused = {"amsgrad": False, "maximize": False, "nesterov": False, "dampening": 0}
    for key, allowed in refused.items():
        if key in first and first[key] not in (allowed, 0):
            raise NotSupportedError(
                f"configure_optimizers: {kind}({key}={first[key]!r}) has no zerocc optimizer; "
                f"allowed: {key}={allowed!r}"
            )
    fields = {"name": name}
    opt_set = base.optimizer.model_fields_set
    _agree("name" in opt_set, "optimizer.name", base.optimizer.name, f"configure_optimizers' "
           f"optimizer ({kind}) as optimizer.name", name)  # fmt: skip

    def read(field: str, key: str, plan_value: Any, value: Any) -> None:
        source = f"configure_optimizers' {kind}({key}=...)"
        fields[field] = _agree(field in opt_set, f"optimizer.{field}", plan_value, source, value)

    lr = first.get("initial_lr", first["lr"])  # a scheduler moves lr; initial_lr is the base
    if run.scheduler is None:
        read("lr", "lr", base.optimizer.lr, lr)
    if name == "adamw":
        read("betas", "betas", tuple(base.optimizer.betas), tuple(first["betas"]))
        read("eps", "eps", base.optimizer.eps, first["eps"])
    else:
        read("momentum", "momentum", base.optimizer.momentum, first["momentum"])
    read("weight_decay", "weight_decay", base.optimizer.weight_decay, first["weight_decay"])
    return fields


def _grad_clip(run: LightningRun, base: Plan) -> float | None:
    """Trainer(gradient_clip_val=...) as the plan's optimizer.grad_clip (by norm only)."""
    clip = run.gradient_clip_val or None
    if clip is not None and run.gradient_clip_algorithm not in (None, "norm"):
        raise NotSupportedError(
            f"Trainer(gradient_clip_algorithm={run.gradient_clip_algorithm!r}): zerocc's step "
            "clips by the global L2 norm only (gradient_clip_algorithm='norm', the plan's "
            "optimizer.grad_clip)"
        )
    return _agree(
        "grad_clip" in base.optimizer.model_fields_set, "optimizer.grad_clip",
        base.optimizer.grad_clip, "Trainer(gradient_clip_val)", clip,
    )  # fmt: skip


def _precision(run: LightningRun, base: Plan, tree: dict[str, Any]) -> None:
    """Lightning's precision as the plan's precision.param."""
    wanted = PRECISIONS.get(run.precision)
    if wanted is None:
        raise NotSupportedError(
            f"Trainer(precision={run.precision!r}) has no zerocc precision; allowed: "
            f"{', '.join(PRECISIONS)} (the plan's precision.param: fp32, bf16, fp16)"
        )
    param_set = "param" in base.precision.model_fields_set
    if wanted == "fp32" and not param_set:
        return  # the Trainer's default stands for no choice: the plan's stays
    if param_set and base.precision.param != wanted and wanted != "fp32":
        raise PlanError(
            f"Trainer(precision={run.precision!r}) conflicts with the plan's precision.param: "
            f"{base.precision.param}; set the precision in one place (the plan's, with the "
            "Trainer's default precision='32-true')"
        )
    if not param_set:
        tree.setdefault("precision", {})["param"] = wanted


def scheduler_rates(run: LightningRun) -> list[float]:
    """The rate of each of the run's optimizer steps under the scheduler, as Lightning steps
    it (after each ``frequency`` steps or epochs); the scheduler and optimizer are left as
    they were."""
    optimizer, config = run.optimizer, run.scheduler
    if config is None:
        return [optimizer.param_groups[0]["lr"]] * run.total_steps
    scheduler = config.scheduler
    kind = type(scheduler).__name__
    if config.reduce_on_plateau:
        raise NotSupportedError(
            f"configure_optimizers' {kind} changes the rate on a monitored metric; zerocc's "
            "schedule is fixed in advance: use a LambdaLR the plan's schedule expresses"
        )
    every = max(1, config.frequency) * (run.steps_per_epoch if config.interval == "epoch" else 1)
    saved = scheduler.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    rates = []
    try:
        with warnings.catch_warnings():  # (stepped without optimizer.step(): torch warns)
            warnings.simplefilter("ignore")
            for step in range(run.total_steps):
                if step and step % every == 0:
                    scheduler.step()
                group = optimizer.param_groups[0]
                if any(group.get(k) != groups[0].get(k) for k in ("betas", "momentum")):
                    raise NotSupportedError(
                        f"configure_optimizers' {kind} changes the optimizer's momentum "
                        f"(cycle_momentum); zerocc's betas and momentum are fixed: pass "
                        "cycle_momentum=False"
                    )
                rates.append(group["lr"])
    finally:
        scheduler.load_state_dict(saved)
        for group, kept in zip(optimizer.param_groups, groups, strict=True):
            group.update(kept)
    return rates


def _candidates(rates: list[float]) -> list[dict[str, Any]]:
    """The plan schedules that might give ``rates``: a warmup to the peak, then constant or a
    linear or cosine decay whose length the first decayed step tells."""
    peak = max(rates)
    warmup = next(i for i, r in enumerate(rates) if r >= peak * (1 - RATE_TOLERANCE))
    found: list[dict[str, Any]] = [{"name": "constant", "warmup_steps": warmup}]
    if warmup + 1 < len(rates) and rates[warmup + 1] < peak:
        factor = rates[warmup + 1] / peak
        if factor < 1:
            found.append({"name": "linear", "warmup_steps": warmup,
                          "total_steps": warmup + round(1 / (1 - factor))})  # fmt: skip
        progress = math.acos(max(-1.0, min(1.0, 2 * factor - 1))) / math.pi
        if progress > 0:
            found.append({"name": "cosine", "warmup_steps": warmup,
                          "total_steps": warmup + round(1 / progress)})  # fmt: skip
    return found


def _parted_at(optimizer: OptimizerConfig, rates: list[float]) -> int | None:
    """The first step where the plan's rate is not ``rates``' (None: they are the same)."""
    for step, rate in enumerate(rates):
        if not math.isclose(lr_at(optimizer, step), rate, rel_tol=RATE_TOLERANCE, abs_tol=1e-30):
            return step
    return None


def _schedule(run: LightningRun, base: Plan, optimizer: dict[str, Any]) -> None:
    """The plan's schedule (and peak lr) that gives the scheduler's rates, written into
    ``optimizer``; the plan's own schedule must give them where the plan set one."""
    rates = scheduler_rates(run)
    kind = type(run.scheduler.scheduler).__name__ if run.scheduler is not None else "no scheduler"
    if "schedule" in base.optimizer.model_fields_set:
        if run.scheduler is None:
            return  # no scheduler is Lightning's default: the plan's schedule stands
        candidates = [base.optimizer.schedule.model_dump(mode="json")]
    else:
        candidates = _candidates(rates) if rates else [{"name": "constant"}]
    peak = base.optimizer.lr if "lr" in base.optimizer.model_fields_set else max(rates)
    if run.scheduler is not None and "lr" in base.optimizer.model_fields_set:
        _agree(True, "optimizer.lr", base.optimizer.lr, f"{kind}'s peak rate", max(rates))
    parted = None
    for schedule in candidates:
        trial = OptimizerConfig(**{**optimizer, "lr": peak, "schedule": schedule})
        parted = _parted_at(trial, rates)
        if parted is None:
            optimizer["lr"], optimizer["schedule"] = peak, schedule
            return
    step = parted or 0
    raise NotSupportedError(
        f"configure_optimizers' {kind} gives rates no plan schedule expresses (step {step}: "
        f"{rates[step]:.6g}, the nearest plan schedule {candidates[-1]['name']}: "
        f"{lr_at(trial, step):.6g}); zerocc's schedules are constant, linear or cosine with a "
        "linear warmup from 0 (a LambdaLR of get_*_schedule_with_warmup, interval 'step'), or "
        "the plan's optimizer.schedule with no scheduler"
    )


def plan_for_lightning(plan: str | os.PathLike | dict | Plan, run: LightningRun) -> Plan:
    """``plan`` with what the Lightning run sets written into the fields the plan left unset,
    each field set by both checked to agree; a setting zerocc cannot honour is refused."""
    base = load_plan(plan)
    if base.parallel.pp > 1:
        raise NotSupportedError(
            f"parallel.pp: {base.parallel.pp} under ZeroccStrategy: a pipeline's call trains a "
            "whole step's batch, Lightning's loop gives one micro-batch at a time; use "
            "`zerocc train` or zerocc.compile for pipelines"
        )
    tree = base.model_dump(mode="json", exclude_unset=True)
    optimizer = {**tree.get("optimizer", {}), **_optimizer_fields(run, base)}
    optimizer["grad_clip"] = _grad_clip(run, base)
    _schedule(run, base, optimizer)
    tree["optimizer"] = optimizer
    tree["grad_accumulation"] = _agree(
        "grad_accumulation" in base.model_fields_set, "grad_accumulation",
        base.grad_accumulation, "Trainer(accumulate_grad_batches)", run.accumulate_grad_batches,
    )  # fmt: skip
    _precision(run, base, tree)
    return load_plan(tree)
