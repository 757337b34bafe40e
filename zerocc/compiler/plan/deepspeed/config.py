"""DeepSpeed configs (``ds_config.json``) as zerocc plans.

:func:`convert` reads every key of a DeepSpeed config and says, key by key, what it became in
the plan (``mapped``), why it means nothing to zerocc (``ignored``: logging, knobs of
DeepSpeed's own buffers, the batch size that belongs to the workload), or that zerocc cannot
do what it asks (``unsupported``). A key this module does not know is unsupported too: nothing
is dropped without a word. :func:`plan_from_deepspeed` turns the outcomes into a plan dict, and
raises one PlanError listing every unsupported key.

Where DeepSpeed's default differs from zerocc's and the difference changes the numbers, the
plan gets DeepSpeed's value written out (its loss-scale window of 1000 steps, gradients reduced
in the compute dtype, WarmupDecayLR's peak rate of 0.001), so an imported config trains as
DeepSpeed would. Values of ``"auto"`` (what Hugging Face's integration fills in) are left at
zerocc's default, said per key. Sizes DeepSpeed counts in elements become zerocc's MB at the
compute dtype's size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zerocc.errors import PlanError

Kind = Literal["mapped", "ignored", "unsupported"]

# Keys whose presence tells a DeepSpeed config from a zerocc plan written as JSON.
DEEPSPEED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "fp16",
        "bf16",
        "gradient_clipping",
        "steps_per_print",
        "scheduler",
    }
)
_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "float32": "fp32",
           "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}  # fmt: skip
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Outcome:
    """What one DeepSpeed key became."""

    key: str  # dotted path in the DeepSpeed config
    value: Any
    kind: Kind
    note: str  # the plan field it set, or why it was ignored, or what is not supported

    def line(self) -> str:
        """``kind key = value: note``, as `zerocc plan import` prints it."""
        value = "{...}" if isinstance(self.value, dict) else json.dumps(self.value)
        value = "(not set)" if self.value is None else value
        return f"{self.kind:<11} {self.key} = {value}: {self.note}"


class _Conversion:
    """The plan being built and what each key became."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.plan: dict[str, Any] = {}
        self.outcomes: list[Outcome] = []
        self.param = "fp32"  # the compute dtype, once fp16/bf16 are read

    def set(self, path: str, value: Any) -> None:
        """Set the plan field at dotted ``path``."""
        *parents, leaf = path.split(".")
        node = self.plan
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value

    def mapped(self, key: str, value: Any, path: str, plan_value: Any, note: str = "") -> None:
        self.set(path, plan_value)
        shown = json.dumps(plan_value)
        self.outcomes.append(
            Outcome(key, value, "mapped", f"{path}: {shown}" + (f" ({note})" if note else ""))
        )

    def ignored(self, key: str, value: Any, why: str) -> None:
        self.outcomes.append(Outcome(key, value, "ignored", why))

    def unsupported(self, key: str, value: Any, why: str) -> None:
        self.outcomes.append(Outcome(key, value, "unsupported", why))

    def auto(self, key: str, value: Any, default: str) -> bool:
        """Whether ``value`` is "auto" (recorded as ignored: zerocc's ``default`` applies)."""
        if value == "auto":
            self.ignored(
                key,
                value,
                f"'auto' is for Hugging Face's Trainer to fill; zerocc's default applies "
                f"({default})",
            )
            return True
        return False


Handler = Callable[[_Conversion, str, Any], None]


def _ignore(why: str) -> Handler:
    return lambda conv, key, value: conv.ignored(key, value, why)


def _feature(what: str) -> Handler:
    """A DeepSpeed feature zerocc does not have: fine when disabled, else unsupported."""

    def handle(conv: _Conversion, key: str, value: Any) -> None:
        enabled = value.get("enabled", True) if isinstance(value, dict) else bool(value)
        if enabled:
            conv.unsupported(key, value, f"{what}: not in zerocc; remove it or disable it")
        else:
            conv.ignored(key, value, "disabled")

    return handle


def _elements_mb(conv: _Conversion, elements: float) -> float:
    """DeepSpeed's sizes count elements; zerocc's count MB at the compute dtype's size."""
    return round(elements * _ITEMSIZE[conv.param] / 2**20, 3)


def _number(
    conv: _Conversion, key: str, value: Any, kinds: tuple[type, ...] = (int, float)
) -> bool:
    if isinstance(value, bool) or not isinstance(value, kinds):
        conv.unsupported(key, value, f"expected a number, got {json.dumps(value)}")
        return False
    return True


# -- precision ----------------------------------------------------------------------------------

LOGGING = ("logging and profiling of DeepSpeed's engine; `zerocc train --metrics FILE "
           "--tensorboard DIR` records loss, lr, tokens/s and memory")  # fmt: skip


def _half(conv: _Conversion, key: str, block: Any) -> None:
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


def _fp16_knob(conv: _Conversion, key: str, name: str, value: Any) -> None:
    if name == "loss_scale":
        if _number(conv, key, value) and value > 0:
            conv.mapped(key, value, "precision.loss_scale", value, "a static scale")
        elif value == 0:
            conv.mapped(key, value, "precision.loss_scale", "dynamic")
    elif name == "initial_scale_power":
        if _number(conv, key, value, (int,)):
            conv.mapped(
                key, value, "precision.dynamic.initial", 2.0**value, "2^initial_scale_power"
            )
    elif name == "loss_scale_window":
        if _number(conv, key, value, (int,)):
            conv.mapped(key, value, "precision.dynamic.growth_interval", value)
    elif name == "hysteresis":
        if _number(conv, key, value, (int,)):
            conv.mapped(key, value, "precision.dynamic.hysteresis", value)
    elif name == "min_loss_scale":
        if _number(conv, key, value):
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


def _fp16_defaults(conv: _Conversion, block: dict) -> None:
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


def _reduce_dtype(conv: _Conversion, key: str, value: Any) -> None:
    dtype = _DTYPES.get(str(value).lower())
    if dtype is None:
        conv.unsupported(key, value, "allowed: fp32, fp16, bf16")
    else:
        conv.mapped(key, value, "precision.reduce", dtype, "the dtype gradients are reduced in")


def _data_types(conv: _Conversion, key: str, block: Any) -> None:
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


def _precision_defaults(conv: _Conversion) -> None:
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


# -- zero_optimization --------------------------------------------------------------------------

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


def _zero(conv: _Conversion, key: str, block: Any) -> None:
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
                continue
            conv.mapped(
                sub,
                value,
                "overlap.enabled",
                bool(value),
                "collectives on a second stream, overlapped with compute",
            )
        elif name == "stage3_prefetch_bucket_size":
            if conv.auto(sub, value, "no in-flight budget") or not _number(conv, sub, value):
                continue
            conv.mapped(
                sub,
                value,
                "overlap.max_inflight_mb",
                _elements_mb(conv, value),
                f"{value:g} elements in {conv.param}",
            )
        elif name == "stage3_param_persistence_threshold":
            if conv.auto(sub, value, "none kept") or not _number(conv, sub, value):
                continue
            if stage != 3:
                conv.ignored(sub, value, f"applies at stage 3 (this config: stage {stage})")
            elif value > 0:
                conv.mapped(
                    sub,
                    value,
                    "units.keep_gathered_below_mb",
                    _elements_mb(conv, value),
                    "units smaller than this stay gathered for the step (DeepSpeed: parameters)",
                )
            else:
                conv.ignored(sub, value, "none kept")
        elif name == "zero_hpz_partition_size":
            if value in (None, 1):
                conv.ignored(sub, value, "no secondary partition")
            else:
                conv.unsupported(
                    sub, value, "ZeRO++ hierarchical partitioning (hpZ) is not in zerocc"
                )
        elif name in (
            "zero_quantized_weights",
            "zero_quantized_gradients",
            "zero_quantized_nontrainable_weights",
        ):
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
        elif name in _ZERO_IGNORED:
            conv.ignored(sub, value, _ZERO_IGNORED[name])
        else:
            conv.unsupported(sub, value, "not a zero_optimization option zerocc knows")


def _offload(conv: _Conversion, key: str, name: str, block: Any) -> None:
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
            if _number(conv, sub, value):
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


# -- optimizer and scheduler ----------------------------------------------------------------------

_OPTIMIZERS = {
    "adam": "adamw",
    "adamw": "adamw",
    "sgd": "sgd",
    "fusedadam": "adamw",
    "cpuadam": "adamw",
}


def _optimizer(conv: _Conversion, key: str, block: Any) -> None:
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
            if not conv.auto(sub, value, "zerocc's default") and _number(conv, sub, value):
                conv.mapped(sub, value, f"optimizer.{option}", value)
        elif option == "betas":
            if not conv.auto(sub, value, "zerocc's default [0.9, 0.999]"):
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


def _scheduler(conv: _Conversion, key: str, block: Any) -> None:
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
            if not conv.auto(sub, value, _SCHEDULE_DEFAULTS.get(option, "zerocc's default")):
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


def _activation_checkpointing(conv: _Conversion, key: str, block: Any) -> None:
    why = ("configures deepspeed.checkpointing.checkpoint, which a model calls itself; zerocc "
           "recomputes the units recompute.units names (e.g. all)")  # fmt: skip
    for option, value in (block or {}).items():
        sub = f"{key}.{option}"
        if option in ("partition_activations", "cpu_checkpointing") and value:
            conv.unsupported(
                sub,
                value,
                "zerocc keeps activations whole on each rank's device; recompute them with "
                "recompute.units",
            )
        else:
            conv.ignored(sub, value, why)


# -- the whole config -----------------------------------------------------------------------

_TOP: dict[str, Handler] = {
    "train_batch_size": _ignore(
        "the global batch is the workload's batches x ranks x grad_accumulation"
    ),
    "train_micro_batch_size_per_gpu": _ignore(
        "each rank trains on the batches its workload yields (set the workload's batch size, e.g. "
        "workload_args.batch_size)"
    ),
    "dataloader_drop_last": _ignore("the data is the workload's"),
    "steps_per_print": _ignore(LOGGING),
    "wall_clock_breakdown": _ignore(LOGGING),
    "dump_state": _ignore(LOGGING),
    "memory_breakdown": _ignore(LOGGING),
    "flops_profiler": _ignore(LOGGING),
    "tensorboard": _ignore(LOGGING),
    "wandb": _ignore(LOGGING),
    "csv_monitor": _ignore(LOGGING),
    "comms_logger": _ignore(LOGGING),
    "prescale_gradients": _ignore("zerocc divides the summed gradient once, after the reduction"),
    "gradient_predivide_factor": _ignore(
        "zerocc divides the summed gradient once, after the reduction"
    ),
    "zero_allow_untested_optimizer": _ignore("zerocc's optimizers are its own (adamw, sgd)"),
    "zero_force_ds_cpu_optimizer": _ignore("zerocc's host update is its own"),
    "aio": _ignore(
        "tunes DeepSpeed's async NVMe library; zerocc's NVMe offload has its own engine"
    ),
    "checkpoint": _ignore(
        "DeepSpeed's checkpoint engine; zerocc's checkpoints (zerocc train --save) load under any "
        "world size"
    ),
    "load_universal_checkpoint": _ignore("zerocc's checkpoints load under any world size"),
    "amp": _feature("NVIDIA Apex AMP (use fp16 or bf16)"),
    "elasticity": _feature("elastic training"),
    "autotuning": _feature("DeepSpeed's autotuner"),
    "compression_training": _feature("compression training"),
    "data_efficiency": _feature("data efficiency (curriculum, random-LTD)"),
    "curriculum_learning": _feature("curriculum learning"),
    "pipeline": _feature("pipeline parallelism"),
    "sparse_attention": _feature("sparse attention"),
    "sparse_gradients": _feature("sparse gradients"),
    "progressive_layer_drop": _feature("progressive layer drop"),
    "eigenvalue": _feature("eigenvalue computation"),
    "hybrid_engine": _feature("the RLHF hybrid engine"),
    "tensor_parallel": _feature("tensor parallelism (issue 21)"),
    "sequence_parallel_size": _feature("sequence parallelism"),
    "gradient_accumulation_steps": lambda c, k, v: _accumulation(c, k, v),
    "gradient_clipping": lambda c, k, v: _clipping(c, k, v),
    "fp16": _half,
    "bf16": _half,
    "communication_data_type": _reduce_dtype,
    "data_types": _data_types,
    "zero_optimization": _zero,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "activation_checkpointing": _activation_checkpointing,
}


def _accumulation(conv: _Conversion, key: str, value: Any) -> None:
    if not conv.auto(key, value, "grad_accumulation: 1") and _number(conv, key, value, (int,)):
        conv.mapped(key, value, "grad_accumulation", value)


def _clipping(conv: _Conversion, key: str, value: Any) -> None:
    if conv.auto(key, value, "no clipping") or not _number(conv, key, value):
        return
    if value > 0:
        conv.mapped(key, value, "optimizer.grad_clip", value)
    else:
        conv.ignored(key, value, "0: no clipping")


# Read first: the compute dtype they set sizes what zero_optimization converts.
_FIRST = ("fp16", "bf16")


def is_deepspeed_config(data: Any) -> bool:
    """Whether a document is a DeepSpeed config rather than a zerocc plan: a key only
    DeepSpeed has, or an optimizer block in DeepSpeed's form (`type` and `params`, where a
    plan's has `name`)."""
    if not isinstance(data, dict):
        return False
    optimizer = data.get("optimizer")
    deepspeed_optimizer = isinstance(optimizer, dict) and bool({"type", "params"} & set(optimizer))
    return bool(DEEPSPEED_KEYS & set(data)) or deepspeed_optimizer


def convert(config: dict[str, Any]) -> tuple[dict[str, Any], list[Outcome]]:
    """The plan dict a DeepSpeed config becomes, and what each of its keys became."""
    conv = _Conversion(config)
    half = [
        k for k in _FIRST if isinstance(config.get(k), dict) and config[k].get("enabled") is True
    ]
    if len(half) == 2:
        conv.unsupported("fp16.enabled", True, "fp16 and bf16 are both enabled; enable one")
    keys = [k for k in _FIRST if k in config] + [k for k in config if k not in _FIRST]
    for key in keys:
        handler = _TOP.get(key)
        if handler is None:
            conv.unsupported(key, config[key], "not a DeepSpeed option zerocc knows")
        else:
            handler(conv, key, config[key])
    _precision_defaults(conv)
    return conv.plan, conv.outcomes


def plan_from_deepspeed(config: dict[str, Any], where: str) -> tuple[dict[str, Any], list[Outcome]]:
    """:func:`convert`, raising one PlanError (naming ``where``) listing every unsupported
    key, with the reason and what to do."""
    plan, outcomes = convert(config)
    bad = [o for o in outcomes if o.kind == "unsupported"]
    if bad:
        lines = "\n".join(f"  {o.key} = {json.dumps(o.value)}: {o.note}" for o in bad)
        raise PlanError(f"{where}: DeepSpeed config with options zerocc does not support:\n{lines}")
    return plan, outcomes


def read_json(path: Path, where: str) -> Any:
    """The JSON document at ``path``; PlanError naming the file when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{where}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{where}: not a readable JSON file: {exc}") from None
