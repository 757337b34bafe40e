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
from pathlib import Path
from typing import Any

from zerocc.compiler.plan.deepspeed.conversion import (
    LOGGING,
    Conversion,
    Handler,
    Outcome,
    feature,
    ignore,
    number,
)
from zerocc.compiler.plan.deepspeed.optimizer import optimizer, scheduler
from zerocc.compiler.plan.deepspeed.precision import (
    data_types,
    half,
    precision_defaults,
    reduce_dtype,
)
from zerocc.compiler.plan.deepspeed.zero import zero
from zerocc.errors import PlanError

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


def _activation_checkpointing(conv: Conversion, key: str, block: Any) -> None:
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
    "train_batch_size": ignore(
        "the global batch is the workload's batches x ranks x grad_accumulation"
    ),
    "train_micro_batch_size_per_gpu": ignore(
        "each rank trains on the batches its workload yields (set the workload's batch size, e.g. "
        "workload_args.batch_size)"
    ),
    "dataloader_drop_last": ignore("the data is the workload's"),
    "steps_per_print": ignore(LOGGING),
    "wall_clock_breakdown": ignore(LOGGING),
    "dump_state": ignore(LOGGING),
    "memory_breakdown": ignore(LOGGING),
    "flops_profiler": ignore(LOGGING),
    "tensorboard": ignore(LOGGING),
    "wandb": ignore(LOGGING),
    "csv_monitor": ignore(LOGGING),
    "comms_logger": ignore(LOGGING),
    "prescale_gradients": ignore("zerocc divides the summed gradient once, after the reduction"),
    "gradient_predivide_factor": ignore(
        "zerocc divides the summed gradient once, after the reduction"
    ),
    "zero_allow_untested_optimizer": ignore("zerocc's optimizers are its own (optimizer.name)"),
    "zero_force_ds_cpu_optimizer": ignore("zerocc's host update is its own"),
    "aio": ignore("tunes DeepSpeed's async NVMe library; zerocc's NVMe offload has its own engine"),
    "checkpoint": ignore(
        "DeepSpeed's checkpoint engine; zerocc's checkpoints (zerocc train --save) load under any "
        "world size"
    ),
    "load_universal_checkpoint": ignore("zerocc's checkpoints load under any world size"),
    "amp": feature("NVIDIA Apex AMP (use fp16 or bf16)"),
    "elasticity": feature("elastic training"),
    "autotuning": feature("DeepSpeed's autotuner"),
    "compression_training": feature("compression training"),
    "data_efficiency": feature("data efficiency (curriculum, random-LTD)"),
    "curriculum_learning": feature("curriculum learning"),
    "pipeline": feature("pipeline parallelism"),
    "sparse_attention": feature("sparse attention"),
    "sparse_gradients": feature("sparse gradients"),
    "progressive_layer_drop": feature("progressive layer drop"),
    "eigenvalue": feature("eigenvalue computation"),
    "hybrid_engine": feature("the RLHF hybrid engine"),
    "tensor_parallel": feature("tensor parallelism (issue 21)"),
    "sequence_parallel_size": feature("sequence parallelism"),
    "gradient_accumulation_steps": lambda c, k, v: _accumulation(c, k, v),
    "gradient_clipping": lambda c, k, v: _clipping(c, k, v),
    "fp16": half,
    "bf16": half,
    "communication_data_type": reduce_dtype,
    "data_types": data_types,
    "zero_optimization": zero,
    "optimizer": optimizer,
    "scheduler": scheduler,
    "activation_checkpointing": _activation_checkpointing,
}


def _accumulation(conv: Conversion, key: str, value: Any) -> None:
    if not conv.auto(key, value, "grad_accumulation: 1") and number(conv, key, value, (int,)):
        conv.mapped(key, value, "grad_accumulation", value)


def _clipping(conv: Conversion, key: str, value: Any) -> None:
    if conv.auto(key, value, "no clipping") or not number(conv, key, value):
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
    conv = Conversion(config)
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
    precision_defaults(conv)
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
