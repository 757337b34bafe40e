"""DeepSpeed's precision keys (``fp16``, ``bf16``, ``communication_data_type``,
``data_types``) as the plan's precision section."""

from __future__ import annotations

from typing import Any

from zerocc.compiler.plan.deepspeed.conversion import (
    Conversion,
    Outcome,
    number,
)

_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "float32": "fp32",
           "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}  # fmt: skip


def half(conv: Conversion, key: str, block: Any) -> None:
    """``fp16`` or ``bf16``: the compute dtype, with fp16's loss scaler."""
    if not isinstance(block, dict):
        conv.unsupported(key, block, "expected an object with 'enabled'")
        return
    enabled = block.get("enabled", False)
    dtype = key  # fp16 | bf16
    for name, value in block.items():
        sub = f"{key}.{name}"
        if name == "enabled":
            if value == "auto":
                conv.ignored(
                    sub, value, f"'auto' is for Hugging Face's Trainer to fill; {key} stays off"
                )
            elif value:
                conv.mapped(
                    sub,
                    value,
                    "precision.param",
                    dtype,
                    "the compute dtype; fp32 master weights, as DeepSpeed keeps",
                )
                conv.param = dtype
            else:
                conv.ignored(sub, value, f"{key} is off")
        elif not enabled or enabled == "auto":
            conv.ignored(sub, value, f"{key} is not enabled")
        elif dtype == "fp16":
            _fp16_knob(conv, sub, name, value)
        elif name in ("immediate_grad_update", "check_grad_overflow", "accumulate_grads_via_hooks"):
            conv.ignored(
                sub,
                value,
                "how DeepSpeed's bf16 optimizer applies gradients; zerocc accumulates in "
                "precision.grad",
            )
        else:
            conv.unsupported(sub, value, "not a bf16 option zerocc knows")
    if enabled is True and dtype == "fp16":
        _fp16_defaults(conv, block)


def _fp16_knob(conv: Conversion, key: str, name: str, value: Any) -> None:
    if name == "loss_scale":
        if number(conv, key, value) and value > 0:
            conv.mapped(key, value, "precision.loss_scale", value, "a static scale")
        elif value == 0:
            conv.mapped(key, value, "precision.loss_scale", "dynamic")
    elif name == "initial_scale_power":
        if number(conv, key, value, (int,)):
            conv.mapped(
                key, value, "precision.dynamic.initial", 2.0**value, "2^initial_scale_power"
            )
    elif name == "loss_scale_window":
        if number(conv, key, value, (int,)):
            conv.mapped(key, value, "precision.dynamic.growth_interval", value)
    elif name == "hysteresis":
        if number(conv, key, value, (int,)):
            conv.mapped(key, value, "precision.dynamic.hysteresis", value)
    elif name == "min_loss_scale":
        if number(conv, key, value):
            conv.mapped(key, value, "precision.dynamic.min_scale", float(value))
    elif name == "consecutive_hysteresis":
        if value:
            conv.unsupported(
                key,
                value,
                "zerocc refills the hysteresis when the scale grows, as DeepSpeed's default "
                "(false)",
            )
        else:
            conv.ignored(key, value, "DeepSpeed's default: zerocc's hysteresis works the same way")
    elif name == "auto_cast":
        conv.ignored(key, value, "zerocc casts floating batch tensors to the compute dtype itself")
    elif name == "fp16_master_weights_and_grads":
        if value:
            conv.mapped(key, value, "precision.master", "fp16", "fp16 master weights")
        else:
            conv.ignored(key, value, "fp32 master weights, zerocc's default")
    else:
        conv.unsupported(key, value, "not an fp16 option zerocc knows")


def _fp16_defaults(conv: Conversion, block: dict) -> None:
    """DeepSpeed's dynamic loss scaler where the block leaves it: 2^16, a window of 1000
    steps (zerocc's default is torch's 2000), hysteresis 2, minimum 1."""
    if block.get("loss_scale", 0) != 0:
        return
    plan_dynamic = conv.plan.setdefault("precision", {}).setdefault("dynamic", {})
    conv.plan["precision"].setdefault("loss_scale", "dynamic")
    for name, field, value in (
        ("initial_scale_power", "initial", 2.0**16),
        ("loss_scale_window", "growth_interval", 1000),
        ("hysteresis", "hysteresis", 2),
        ("min_loss_scale", "min_scale", 1.0),
    ):
        if name not in block:
            plan_dynamic[field] = value
            conv.outcomes.append(
                Outcome(
                    f"fp16.{name}",
                    None,
                    "mapped",
                    f"precision.dynamic.{field}: {value} (DeepSpeed's default, written out)",
                )
            )


def reduce_dtype(conv: Conversion, key: str, value: Any) -> None:
    """``communication_data_type``: the dtype gradients are reduced in."""
    dtype = _DTYPES.get(str(value).lower())
    if dtype is None:
        conv.unsupported(key, value, "allowed: fp32, fp16, bf16")
    else:
        conv.mapped(key, value, "precision.reduce", dtype, "the dtype gradients are reduced in")


def data_types(conv: Conversion, key: str, block: Any) -> None:
    """``data_types``: the dtype gradients are accumulated in."""
    for name, value in (block or {}).items():
        sub = f"{key}.{name}"
        dtype = _DTYPES.get(str(value).lower())
        if name == "grad_accum_dtype" and dtype is not None:
            conv.mapped(
                sub, value, "precision.grad", dtype, "the dtype gradients are accumulated in"
            )
        else:
            conv.unsupported(
                sub, value, "zerocc knows data_types.grad_accum_dtype (fp32, fp16, bf16)"
            )


def precision_defaults(conv: Conversion) -> None:
    """DeepSpeed reduces gradients in the compute dtype unless communication_data_type says
    otherwise (zerocc's default is fp32): written out for parity."""
    if conv.param != "fp32" and "communication_data_type" not in conv.config:
        conv.set("precision.reduce", conv.param)
        conv.outcomes.append(
            Outcome(
                "communication_data_type",
                None,
                "mapped",
                f"precision.reduce: {conv.param} (DeepSpeed's default: the compute dtype, written "
                f"out)",
            )
        )
