"""A Hugging Face ``TrainingArguments`` read as a zerocc plan: what the Trainer's arguments set
(the optimizer, its schedule, clipping, accumulation, precision) becomes the plan's fields, and
an argument the plan cannot honour, or that disagrees with a field the plan set itself, is
refused by name (:class:`zerocc.errors.PlanError`), as the Trainer refuses a DeepSpeed config
whose explicit values differ from its arguments.

The rule for a field both sides can set: the plan's value stands where the plan set it (a YAML
or dict field, a DeepSpeed key other than ``"auto"``) and must then equal the argument's; where
the plan left it unset, the argument's value is written in. Only the schedule's length waits
for training (:func:`plan_for_training`): the Trainer knows its number of steps then.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from zerocc.compiler.plan import Plan, load_plan
from zerocc.errors import PlanError

# TrainingArguments.optim values that are zerocc's optimizers (the same update: torch's AdamW,
# fused or not, and SGD); any other is refused by name.
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}

# lr_scheduler_type -> the plan's schedule, and whether the Trainer applies its warmup there
# (its "constant" ignores warmup_steps; zerocc's constant warms up, as constant_with_warmup).
SCHEDULES = {
    "constant": ("constant", False),
    "constant_with_warmup": ("constant", True),
    "linear": ("linear", True),
    "cosine": ("cosine", True),
}

# Arguments that ask the Trainer for something zerocc's step does itself or not at all: the
# argument, whether a value turns it on, and what to do instead.
REFUSED: dict[str, str] = {
    "deepspeed": "the plan shards the model: pass the DeepSpeed config as plan= instead "
    "(zerocc reads it as `zerocc plan import` does)",
    "fsdp": "the plan shards the model (zero.stage: 3 is FSDP's full sharding): drop fsdp",
    "torch_compile": "the plan's backend compiles the step (backend.name: inductor): drop "
    "torch_compile",
    "use_liger_kernel": "zerocc captures the model's own layers: drop use_liger_kernel",
}


def _value(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def refuse_unsupported(args: Any) -> None:
    """The arguments zerocc cannot honour, refused by name before anything is built."""
    for name, instead in REFUSED.items():
        value = _value(args, name)
        if value not in (None, False, "", [], {}):
            raise PlanError(
                f"TrainingArguments.{name}={value!r} is not used with zerocc: {instead}"
            )
    if _value(args, "label_smoothing_factor"):
        raise PlanError(
            f"TrainingArguments.label_smoothing_factor={args.label_smoothing_factor}: the "
            "step's loss is the model's own; drop it"
        )
    if _value(args, "load_best_model_at_end"):
        raise PlanError(
            "TrainingArguments.load_best_model_at_end=True is not supported with zerocc: load "
            "the best checkpoint-N's zerocc/ folder with trainer.zerocc_step.load instead"
        )
    optim = str(getattr(_value(args, "optim"), "value", _value(args, "optim")))
    if optim not in OPTIMIZERS:
        raise PlanError(
            f"TrainingArguments.optim={optim!r} is not an optimizer zerocc has; allowed: "
            f"{', '.join(OPTIMIZERS)} (or the plan's optimizer.name)"
        )
    if _value(args, "optim_args"):
        raise PlanError(
            "TrainingArguments.optim_args is not read by zerocc: set the plan's optimizer fields"
        )
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if schedule not in SCHEDULES:
        raise PlanError(
            f"TrainingArguments.lr_scheduler_type={schedule!r} has no zerocc schedule; allowed: "
            f"{', '.join(SCHEDULES)} (or the plan's optimizer.schedule)"
        )
    if args.lr_scheduler_kwargs:
        raise PlanError(
            f"TrainingArguments.lr_scheduler_kwargs={args.lr_scheduler_kwargs!r} is not read by "
            "zerocc: set the plan's optimizer.schedule fields (min_lr, ...) instead"
        )


def _agree(plan_set: bool, field: str, plan_value: Any, arg: str, arg_value: Any) -> Any:
    """The value of a field both sides set: the argument's where the plan left it unset, else
    the plan's, which must be the argument's."""
    if plan_set and plan_value != arg_value:
        raise PlanError(
            f"TrainingArguments.{arg}={arg_value!r} conflicts with the plan's {field}: "
            f"{plan_value!r}; set one of them only, or the same value in both"
        )
    return arg_value


def no_decay_parameters(model: nn.Module, decayed: list[str]) -> list[str]:
    """The trainable parameters the Trainer would not decay (biases and norms: its
    ``get_decay_parameter_names``), given the ones it decays."""
    keep = set(decayed)
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in keep]


def merged_plan(
    plan: str | os.PathLike | dict | Plan, args: Any, no_decay: list[str] | None = None
) -> Plan:
    """``plan`` with the Trainer's arguments written into the fields the plan left unset, each
    field set by both checked to agree (the schedule's length is set by
    :func:`plan_for_training`). ``no_decay``: the parameters the Trainer keeps from weight
    decay, which zerocc's optimizer (one decay for every parameter) cannot keep apart."""
    refuse_unsupported(args)
    base = load_plan(plan)
    tree = base.model_dump(mode="json", exclude_unset=True)
    opt_set = base.optimizer.model_fields_set
    optimizer = tree.setdefault("optimizer", {})
    name = OPTIMIZERS[str(getattr(args.optim, "value", args.optim))]
    # The plan's optimizer stands where it names one (as a DeepSpeed config's optimizer
    # replaces the Trainer's): the Trainer's default optim is no choice of the user's.
    optimizer["name"] = base.optimizer.name if "name" in opt_set else name
    optimizer["lr"] = _agree(
        "lr" in opt_set, "optimizer.lr", base.optimizer.lr, "learning_rate", args.learning_rate
    )
    if optimizer["name"] == "adamw":
        betas = (args.adam_beta1, args.adam_beta2)
        plan_betas = tuple(base.optimizer.betas)
        optimizer["betas"] = list(
            _agree("betas" in opt_set, "optimizer.betas", plan_betas, "adam_beta1/2", betas)
        )
        optimizer["eps"] = _agree(
            "eps" in opt_set, "optimizer.eps", base.optimizer.eps, "adam_epsilon", args.adam_epsilon
        )
    decay = _agree(
        "weight_decay" in opt_set,
        "optimizer.weight_decay",
        base.optimizer.weight_decay,
        "weight_decay",
        args.weight_decay,
    )
    if decay and no_decay:
        shown = ", ".join(no_decay[:3]) + (", ..." if len(no_decay) > 3 else "")
        raise PlanError(
            f"TrainingArguments.weight_decay={decay!r}: the Trainer keeps {len(no_decay)} "
            f"parameters ({shown}: biases and norms) from decay, zerocc's optimizer decays "
            "every parameter; set weight_decay=0, or optimizer.weight_decay in the plan alone "
            "(weight_decay=0 here) to decay them all"
        )
    optimizer["weight_decay"] = decay
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    optimizer["grad_clip"] = _agree(
        "grad_clip" in opt_set, "optimizer.grad_clip", base.optimizer.grad_clip,
        "max_grad_norm", clip,
    )  # fmt: skip
    tree["grad_accumulation"] = _agree(
        "grad_accumulation" in base.model_fields_set,
        "grad_accumulation",
        base.grad_accumulation,
        "gradient_accumulation_steps",
        args.gradient_accumulation_steps,
    )
    _merge_precision(tree, base, args)
    # The Trainer's activation checkpointing (TRL's SFTConfig turns it on by default) is the
    # plan's recompute of every unit, unless the plan chose its units itself.
    checkpointing = _value(args, "activation_checkpointing") or _value(
        args, "gradient_checkpointing"
    )
    if checkpointing and "recompute" not in base.model_fields_set:
        tree["recompute"] = {"units": "all"}
    return load_plan(tree)


def _merge_precision(tree: dict, base: Plan, args: Any) -> None:
    """The Trainer's fp16/bf16 as the plan's precision.param (its masters stay fp32, as under
    the Trainer's autocast); refused where the plan set another."""
    wanted = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    param_set = "param" in base.precision.model_fields_set
    if wanted is None:
        return
    if param_set and base.precision.param != wanted:
        raise PlanError(
            f"TrainingArguments.{wanted}=True conflicts with the plan's precision.param: "
            f"{base.precision.param}; set the precision in one place (the plan's precision.param)"
        )
    tree.setdefault("precision", {})["param"] = wanted


def plan_for_training(plan: Plan, args: Any, max_steps: int) -> Plan:
    """``plan`` (from :func:`merged_plan`) with the Trainer's schedule for a run of
    ``max_steps`` optimizer steps, unless the plan set a schedule itself (then the Trainer's
    schedule arguments must be at their defaults)."""
    tree = plan.model_dump(mode="json", exclude_unset=True)
    schedule_type = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    warmup = args.get_warmup_steps(max_steps)
    if "schedule" in plan.optimizer.model_fields_set:
        if schedule_type != "linear" or warmup:
            raise PlanError(
                f"TrainingArguments.lr_scheduler_type={schedule_type!r} (warmup {warmup} "
                f"steps) conflicts with the plan's optimizer.schedule "
                f"({plan.optimizer.schedule.name}); set the schedule in one place"
            )
        return plan
    name, warms_up = SCHEDULES[schedule_type]
    schedule: dict[str, Any] = {"name": name, "warmup_steps": warmup if warms_up else 0}
    if name != "constant":
        # The Trainer's decay ends at its last step; zerocc's needs total > warmup.
        schedule["total_steps"] = max(max_steps, schedule["warmup_steps"] + 1)
    tree["optimizer"]["schedule"] = schedule
    return load_plan(tree)
