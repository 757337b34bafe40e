"""DeepSpeed's ``zero_optimization`` block as the plan's zero, offload, overlap and units
sections."""

from __future__ import annotations

from typing import Any

from zerocc.compiler.plan.deepspeed.conversion import (
    LOGGING,
    Conversion,
    elements_mb,
    number,
)

_BUFFERS = "a knob of DeepSpeed's own buffers; zerocc sizes its own"
_OFFLOAD_BUFFERS = (
    "pin_memory",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "fast_init",
    "pipeline",
    "pipeline_read",
    "pipeline_write",
    "cpuadam_cores_perc",
)
_ZERO_IGNORED = {
    "contiguous_gradients": "zerocc keeps each unit's gradient in one flat buffer always",
    "reduce_scatter": "zerocc reduce-scatters at stages 2-3 and all-reduces at 0-1",
    "allgather_partitions": "zerocc all-gathers each unit's shards in one collective",
    "allgather_bucket_size": "zerocc gathers per unit (overlap.bucket_mb merges small units)",
    "reduce_bucket_size": (
        "zerocc reduces each unit's gradient once it is complete (overlap.bucket_mb merges small "
        "units)"
    ),
    "round_robin_gradients": "a stage 1-2 CPU-offload copy order of DeepSpeed's",
    "load_from_fp32_weights": "zerocc checkpoints keep the fp32 masters and load them",
    "elastic_checkpoint": "zerocc checkpoints load under any world size",
    "ignore_unused_parameters": (
        "parameters the loss does not reach are not updated, as torch.optim"
    ),
    "legacy_stage1": "zerocc has one stage 1",
    "use_multi_rank_bucket_allreduce": "zerocc reduces per unit",
    "sub_group_size": "zerocc's host update runs per unit",
    "stage3_max_live_parameters": (
        "zerocc frees each unit after its last use in a phase; overlap.prefetch and "
        "max_inflight_mb bound what runs ahead"
    ),
    "stage3_max_reuse_distance": (
        "zerocc keeps a unit gathered through its phase; units.keep_gathered keeps it for the step"
    ),
    "stage3_model_persistence_threshold": "units.keep_gathered_below_mb keeps small units gathered",
    "stage3_gather_16bit_weights_on_model_save": (
        "`zerocc export` writes a checkpoint's full weights"
    ),
    "stage3_gather_fp16_weights_on_model_save": (
        "`zerocc export` writes a checkpoint's full weights"
    ),
    "memory_efficient_linear": "zerocc traces the model's own linear layers",
    "pipeline_loading_checkpoint": "zerocc loads checkpoints by name, slice by slice",
    "override_module_apply": "a DeepSpeed hook; zerocc does not patch modules",
    "log_trace_cache_warnings": LOGGING,
    "mics_hierarchical_params_gather": "MiCS is not in zerocc",
    "stage3_module_granularity_threshold": "zerocc's units come from the plan's units section",
}


def zero(conv: Conversion, key: str, block: Any) -> None:
    """``zero_optimization``: the stage, offload, overlap and persistence of the units."""
    if isinstance(block, bool):  # the legacy `"zero_optimization": true` is stage 1
        conv.mapped(key, block, "zero.stage", 1 if block else 0, "legacy boolean form")
        return
    if not isinstance(block, dict):
        conv.unsupported(key, block, "expected an object")
        return
    stage = block.get("stage", 0)
    if "stage" not in block:
        conv.mapped(f"{key}.stage", None, "zero.stage", 0, "DeepSpeed's default, written out")
    for name, value in block.items():
        sub = f"{key}.{name}"
        if _sharding_option(conv, sub, name, value, stage) or _zero_plus_option(
            conv, sub, name, value, stage
        ):
            continue
        if name in _ZERO_IGNORED:
            conv.ignored(sub, value, _ZERO_IGNORED[name])
        else:
            conv.unsupported(sub, value, "not a zero_optimization option zerocc knows")


def _sharding_option(conv: Conversion, sub: str, name: str, value: Any, stage: int) -> bool:
    """Converts the zero_optimization option ``name`` of ZeRO's own sharding, offload and
    overlap; whether it is one."""
    if name == "stage":
        if value in (0, 1, 2, 3) and not isinstance(value, bool):
            conv.mapped(sub, value, "zero.stage", value)
        else:
            conv.unsupported(sub, value, "allowed: 0, 1, 2, 3")
    elif name in ("offload_optimizer", "offload_param"):
        _offload(conv, sub, name, value)
    elif name == "cpu_offload":  # legacy
        if value:
            conv.mapped(
                sub,
                value,
                "offload.optimizer",
                "cpu",
                "legacy form of offload_optimizer.device: cpu",
            )
        else:
            conv.ignored(sub, value, "off")
    elif name in ("cpu_offload_params", "cpu_offload_use_pin_memory"):
        if name == "cpu_offload_params" and value:
            conv.mapped(
                sub, value, "offload.params", "cpu", "legacy form of offload_param.device: cpu"
            )
        else:
            conv.ignored(sub, value, "zerocc pins its host buffers always")
    elif name == "overlap_comm":
        if conv.auto(sub, value, "overlap.enabled: true"):
            return True
        conv.mapped(
            sub,
            value,
            "overlap.enabled",
            bool(value),
            "collectives on a second stream, overlapped with compute",
        )
    elif name == "stage3_prefetch_bucket_size":
        if conv.auto(sub, value, "no in-flight budget") or not number(conv, sub, value):
            return True
        conv.mapped(
            sub,
            value,
            "overlap.max_inflight_mb",
            elements_mb(conv, value),
            f"{value:g} elements in {conv.param}",
        )
    elif name == "stage3_param_persistence_threshold":
        if conv.auto(sub, value, "none kept") or not number(conv, sub, value):
            return True
        if stage != 3:
            conv.ignored(sub, value, f"applies at stage 3 (this config: stage {stage})")
        elif value > 0:
            conv.mapped(
                sub,
                value,
                "units.keep_gathered_below_mb",
                elements_mb(conv, value),
                "units smaller than this stay gathered for the step (DeepSpeed: parameters)",
            )
        else:
            conv.ignored(sub, value, "none kept")
    else:
        return False
    return True


def _zero_plus_option(conv: Conversion, sub: str, name: str, value: Any, stage: int) -> bool:
    """Converts the zero_optimization option ``name`` of ZeRO++ or MiCS (of which zerocc has
    the int8 weight gathers and gradient exchanges and the secondary partition; the others are
    fine when off); whether it
    is one."""
    if name == "zero_hpz_partition_size":
        if value in (None, 1):
            conv.ignored(sub, value, "no secondary partition")
        elif stage != 3:
            conv.ignored(sub, value, f"applies at stage 3 (this config: stage {stage})")
        else:
            conv.mapped(sub, value, "zero.secondary_group", value,
                        "backward gathers over groups of this many ranks (hpZ)")  # fmt: skip
    elif name == "zero_quantized_weights":
        if not value:
            conv.ignored(sub, value, "off")
        elif stage != 3:
            conv.ignored(sub, value, f"applies at stage 3 (this config: stage {stage})")
        else:
            conv.mapped(sub, value, "zero.quantized_weights", "int8",
                        "stage 3's all-gathers in int8 with block scales (qwZ)")  # fmt: skip
    elif name == "zero_quantized_gradients":
        if not value:
            conv.ignored(sub, value, "off")
        elif stage == 0:
            conv.ignored(sub, value, "applies at stages 1-3 (this config: stage 0)")
        else:
            conv.mapped(sub, value, "zero.quantized_grads", "int8",
                        "gradients reduce-scattered in int8 with block scales (qgZ)")  # fmt: skip
    elif name == "zero_quantized_nontrainable_weights":
        if value:
            conv.unsupported(sub, value, "ZeRO++ quantized communication is not in zerocc")
        else:
            conv.ignored(sub, value, "off")
    elif name == "mics_shard_size":
        if value in (None, -1, 0):
            conv.ignored(sub, value, "off")
        else:
            conv.unsupported(
                sub,
                value,
                "MiCS is not converted (the replica count needs the world size): zerocc's "
                f"hybrid sharding is zero.replicate: <world size / {value}>, in a plan",
            )
    else:
        return False
    return True


def _offload(conv: Conversion, key: str, name: str, block: Any) -> None:
    target = "offload.optimizer" if name == "offload_optimizer" else "offload.params"
    if not isinstance(block, dict):
        conv.unsupported(key, block, "expected an object with 'device'")
        return
    device = block.get("device", "none")
    for option, value in block.items():
        sub = f"{key}.{option}"
        if option == "device":
            if value in ("cpu", "nvme"):
                conv.mapped(sub, value, target, value)
            elif value in ("none", None):
                conv.ignored(sub, value, "no offload")
            else:
                conv.unsupported(sub, value, "allowed: cpu, nvme, none")
        elif device in ("none", None):
            conv.ignored(sub, value, "the offload is off")
        elif option == "nvme_path":
            known = conv.plan.get("offload", {}).get("nvme_path")
            if known is not None and known != value:
                conv.unsupported(
                    sub,
                    value,
                    f"zerocc keeps offloaded states in one folder; the other offload names {known}",
                )
            elif device == "nvme":
                conv.mapped(sub, value, "offload.nvme_path", value)
            else:
                conv.ignored(sub, value, f"device is {device}")
        elif option == "ratio" and name == "offload_optimizer":
            if number(conv, sub, value):
                conv.mapped(
                    sub,
                    value,
                    "offload.ratio",
                    value,
                    "share of the parameters whose optimizer states are offloaded (whole units)",
                )
        elif option in _OFFLOAD_BUFFERS:
            conv.ignored(sub, value, _BUFFERS)
        else:
            conv.unsupported(sub, value, f"not a {name} option zerocc knows")
