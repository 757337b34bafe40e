"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks as the plan's optimizer section."""

from __future__ import annotations

from typing import Any

from zerocc.compiler.plan.deepspeed.conversion import (
    Conversion,
    Outcome,
    number,
)

_OPTIMIZERS = {
    "adam": "adamw",
    "adamw": "adamw",
    "sgd": "sgd",
    "fusedadam": "adamw",
    "cpuadam": "adamw",
}


def optimizer(conv: Conversion, key: str, block: Any) -> None:
    """``optimizer``: its type (Adam and AdamW as AdamW, SGD) and parameters."""
    if not isinstance(block, dict):
        conv.unsupported(key, block, "expected an object with 'type' and 'params'")
        return
    kind = str(block.get("type", "")).lower()
    params = block.get("params", {}) or {}
    name = _OPTIMIZERS.get(kind)
    for option in block:
        if option not in ("type", "params"):
            conv.unsupported(
                f"{key}.{option}", block[option], "an optimizer block holds 'type' and 'params'"
            )
    if name is None:
        why = f"type {block.get('type')!r}: zerocc's optimizers are Adam/AdamW (as AdamW) and SGD"
        conv.unsupported(key, block, why)
        return
    if kind == "adam" and params.get("adam_w_mode", True) is False:
        why = "Adam with L2 regularization (adam_w_mode: false); zerocc's is AdamW"
        conv.unsupported(key, block, why + " (decoupled weight decay)")
        return
    note = "DeepSpeed's Adam is AdamW (adam_w_mode defaults to true)" if kind == "adam" else ""
    conv.mapped(f"{key}.type", block.get("type"), "optimizer.name", name, note)
    for option, value in params.items():
        sub = f"{key}.params.{option}"
        if option in ("lr", "eps", "weight_decay") or (option == "momentum" and name == "sgd"):
            if not conv.auto(sub, value, f"optimizer.{option}") and number(conv, sub, value):
                conv.mapped(sub, value, f"optimizer.{option}", value)
        elif option == "betas":
            if not conv.auto(sub, value, "optimizer.betas"):
                conv.mapped(sub, value, "optimizer.betas", list(value))
        elif option in ("adam_w_mode", "torch_adam", "fused", "set_grad_none", "foreach"):
            conv.ignored(sub, value, "which kernel DeepSpeed runs; zerocc's are backend.kernels")
        elif option == "bias_correction" and value is True:
            conv.ignored(sub, value, "zerocc's AdamW corrects the bias, as torch's")
        elif option == "amsgrad" and value is False:
            conv.ignored(sub, value, "off, as zerocc's AdamW")
        elif option in ("dampening", "nesterov") and not value:
            conv.ignored(sub, value, "off, as zerocc's SGD")
        else:
            conv.unsupported(sub, value, f"not supported by zerocc's {name}")


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
