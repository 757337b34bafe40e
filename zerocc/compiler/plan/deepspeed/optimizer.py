"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks as the plan's optimizer section."""

from __future__ import annotations

from typing import Any

from zerocc.compiler.plan.deepspeed.conversion import (
    Conversion,
    Outcome,
    number,
)

# DeepSpeed's optimizer types (its own, and torch.optim's classes, which it builds by name)
# as the plan's optimizers; DeepSpeed's Adam is AdamW unless adam_w_mode is false.
_OPTIMIZERS = {
    "adam": "adamw",
    "adamw": "adamw",
    "fusedadam": "adamw",
    "cpuadam": "adamw",
    "sgd": "sgd",
    "adagrad": "adagrad",
    "rmsprop": "rmsprop",
    "nadam": "nadam",
    "radam": "radam",
    "adamax": "adamax",
    "lion": "lion",
}
# The params each plan optimizer takes, as torch.optim names them (the plan's fields: the
# registry's, zerocc/compiler/plan/optimizers.py, which tests/compiler/plan/test_deepspeed.py
# holds this table to).
_PARAMS = {
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad"),
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
    "nadam": ("lr", "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay"),
    "radam": ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"),
    "adamax": ("lr", "betas", "eps", "weight_decay"),
    "lion": ("lr", "betas", "weight_decay"),
}
# DeepSpeed's types zerocc has no update for, by name, with what they are.
_REFUSED = {
    "onebitadam": "1-bit Adam (compressed communication)",
    "zerooneadam": "0/1 Adam (compressed communication)",
    "onebitlamb": "1-bit LAMB (compressed communication)",
    "lamb": "LAMB (a trust ratio per whole tensor)",
    "fusedlamb": "LAMB (a trust ratio per whole tensor)",
    "muadam": "MuP's Adam (a rate per parameter shape)",
    "muadamw": "MuP's AdamW (a rate per parameter shape)",
    "musgd": "MuP's SGD (a rate per parameter shape)",
    "adafactor": "Adafactor (factored moments of whole matrices)",
    "muon": "Muon (whole matrices)",
}
KNOWN = "Adam, AdamW, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax and Lion"
# Params that choose how DeepSpeed or torch runs the update, not what it computes.
_HOW = ("adam_w_mode", "torch_adam", "fused", "set_grad_none", "foreach", "capturable",
        "differentiable")  # fmt: skip


def optimizer(conv: Conversion, key: str, block: Any) -> None:
    """``optimizer``: its type (DeepSpeed's Adam as AdamW unless adam_w_mode is false, and the
    torch.optim classes DeepSpeed builds by name) and its parameters."""
    if not isinstance(block, dict):
        conv.unsupported(key, block, "expected an object with 'type' and 'params'")
        return
    kind = str(block.get("type", "")).lower()
    params = block.get("params", {}) or {}
    for option in block:
        if option not in ("type", "params"):
            conv.unsupported(
                f"{key}.{option}", block[option], "an optimizer block holds 'type' and 'params'"
            )
    name = _OPTIMIZERS.get(kind)
    if name is None:
        what = "not an optimizer zerocc knows"
        if kind in _REFUSED:
            what = f"DeepSpeed's {_REFUSED[kind]}, which zerocc has not"
        conv.unsupported(key, block, f"type {block.get('type')!r}: {what}; zerocc's are {KNOWN}")
        return
    note = ""
    if kind == "adam":
        if params.get("adam_w_mode", True) is False:
            name, note = "adam", "adam_w_mode: false, Adam with L2 regularization"
        else:
            note = "DeepSpeed's Adam is AdamW (adam_w_mode defaults to true)"
    conv.mapped(f"{key}.type", block.get("type"), "optimizer.name", name, note)
    for option, value in params.items():
        _param(conv, f"{key}.params.{option}", name, option, value)


def _param(conv: Conversion, sub: str, name: str, option: str, value: Any) -> None:
    """One of the optimizer's params as the plan's field of the same name, when ``name`` reads
    it."""
    if option in _PARAMS[name]:
        if conv.auto(sub, value, f"optimizer.{option}"):
            return
        if option == "betas":
            conv.mapped(sub, value, "optimizer.betas", list(value))
        elif option in ("nesterov", "amsgrad", "centered", "decoupled_weight_decay"):
            if isinstance(value, bool):
                conv.mapped(sub, value, f"optimizer.{option}", value)
            else:
                conv.unsupported(sub, value, f"expected true or false, got {value!r}")
        elif number(conv, sub, value):
            conv.mapped(sub, value, f"optimizer.{option}", value)
    elif option in _HOW:
        conv.ignored(sub, value, "which kernel DeepSpeed runs; zerocc's are backend.kernels")
    elif option == "bias_correction" and value is True:
        conv.ignored(sub, value, f"zerocc's {name} corrects the bias, as torch's")
    elif option in ("amsgrad", "maximize", "dampening", "nesterov") and not value:
        conv.ignored(sub, value, f"off, as zerocc's {name}")
    else:
        reads = ", ".join(_PARAMS[name])
        conv.unsupported(sub, value, f"not a parameter of zerocc's {name} (it reads {reads})")


_SCHEDULERS = {
    "warmuplr": "warmup_lr",
    "warmupdecaylr": "warmup_decay_lr",
    "warmupcosinelr": "warmup_cosine_lr",
}
_SCHEDULE_DEFAULTS = {"warmup_max_lr": "optimizer.lr", "warmup_num_steps": "1000, as DeepSpeed",
                      "warmup_min_lr": "0, as DeepSpeed"}  # fmt: skip
_SCHEDULE_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                    "total_num_steps", "warmup_min_ratio", "cos_min_ratio")  # fmt: skip


def scheduler(conv: Conversion, key: str, block: Any) -> None:
    """``scheduler``: WarmupLR, WarmupDecayLR or WarmupCosineLR and their parameters."""
    if not isinstance(block, dict):
        conv.unsupported(key, block, "expected an object with 'type' and 'params'")
        return
    name = _SCHEDULERS.get(str(block.get("type", "")).lower())
    if name is None:
        why = f"type {block.get('type')!r}: zerocc's DeepSpeed schedules are WarmupLR, "
        conv.unsupported(key, block, why + "WarmupDecayLR and WarmupCosineLR")
        return
    conv.mapped(f"{key}.type", block["type"], "optimizer.schedule.name", name)
    params = block.get("params", {}) or {}
    for option, value in params.items():
        sub = f"{key}.params.{option}"
        if option == "last_batch_iteration" and value == -1:
            conv.ignored(
                sub, value, "a new run; a resumed run's position comes from its checkpoint"
            )
        elif option == "total_num_steps" and value == "auto":
            conv.unsupported(
                sub,
                value,
                "'auto' needs Hugging Face's Trainer to fill it: write the number of optimizer "
                "steps",
            )
        elif option in _SCHEDULE_PARAMS:
            default = _SCHEDULE_DEFAULTS.get(option) or f"optimizer.schedule.{option}"
            if not conv.auto(sub, value, default):
                conv.mapped(sub, value, f"optimizer.schedule.{option}", value)
        else:
            conv.unsupported(sub, value, f"not a {block['type']} parameter zerocc knows")
    if name == "warmup_decay_lr" and "warmup_max_lr" not in params:
        conv.set("optimizer.schedule.warmup_max_lr", 0.001)
        conv.outcomes.append(
            Outcome(
                f"{key}.params.warmup_max_lr",
                None,
                "mapped",
                "optimizer.schedule.warmup_max_lr: 0.001 (WarmupDecayLR's default, written out: "
                "zerocc's default is optimizer.lr)",
            )
        )
