"""The plan: a YAML file that says how to shard, optimize and run one training step.

A tree of pydantic models; `load_plan` turns any invalid input into one `PlanError` naming the
file, the YAML path of each bad field, the bad value and what is allowed there.
"""

from __future__ import annotations

import os
import re
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan.deepspeed.config import (
    is_deepspeed_config,
    plan_from_deepspeed,
    read_json,
)
from zerocc.compiler.plan.messages import describe_error, invalid_plan, plan_origin, show
from zerocc.compiler.plan.yaml_file import PlanDataError, check_shape, load_yaml
from zerocc.errors import PlanError, PlanWarning, RenamedFieldWarning

_WORKLOAD_SHAPE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

Beta = Annotated[float, Field(ge=0, lt=1)]

# The smallest positive normal fp32 number: a positive value below it (eps, a loss scale) is a
# subnormal or rounds to 0 in the fp32 arithmetic of the update and the loss scaling.
FP32_TINY = torch.finfo(torch.float32).tiny
# The largest learning rate per optimizer. AdamW moves each weight by about lr per step whatever
# the gradient's scale (its update is normalized), so lr > 1 moves every weight by more than its
# own size each step: what `lr: 1e3` meaning 1e-3 (a dropped minus sign) looks like. An SGD step
# is lr times the gradient, whose scale is the loss's: large-batch recipes reach lr ~3-10.
MAX_LR = {"adamw": 1.0, "sgd": 10.0}
# The largest loss scale: Megatron-LM's initial 2^32 is the largest used in practice; above it
# every step overflows (and is skipped) until the scale has backed off.
MAX_LOSS_SCALE = 2.0**32
# The longest collective timeout: a collective that waits a week is hung (and longer ones
# overflow the process group's millisecond clock for no benefit).
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _no_nul(path: str | None) -> str | None:
    """A path field: no file system allows a NUL byte in a path (open() would raise)."""
    if path is not None and "\0" in path:
        raise ValueError(f"{path!r} contains a NUL byte, which no file system allows in a path")
    return path


PathStr = Annotated[str, AfterValidator(_no_nul)]


class _Section(BaseModel):
    """Base of every plan model: an unknown field (a typo) is an error, not a silent default;
    every float is finite (YAML's .inf and .nan are not numbers a plan can train with), and a
    number is never a YAML boolean (``lr: true`` would read as 1.0)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _takes_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{value!r} is a boolean, not a number")
        return value


def _takes_numbers(annotation: Any) -> bool:
    """Whether a field's type admits plain numbers (int or float, alone or in a union)."""
    if annotation in (int, float):
        return True
    return any(_takes_numbers(arg) for arg in typing.get_args(annotation))


class ZeroConfig(_Section):
    """Which ZeRO stage to apply, and over how many ranks."""

    stage: Literal[0, 1, 2, 3] = Field(
        3, description="0: DDP; 1: shard optimizer state; 2: and gradients; 3: and parameters"
    )
    world_size: int | None = Field(
        None, ge=1, description="expected world size; compile fails clearly under any other"
    )
    replicate: int = Field(
        1,
        ge=1,
        description="hybrid sharding (HSDP): shard each unit over groups of world_size / "
        "replicate consecutive ranks and keep this many replicas, gradients all-reduced across "
        "them (stages 1-3; 1: shard over every rank)",
    )

    @model_validator(mode="after")
    def _replicas_are_sharded(self) -> ZeroConfig:
        if self.replicate > 1 and self.stage == 0:
            raise ValueError(
                f"replicate: {self.replicate} replicates shard groups, but stage 0 shards "
                "nothing (every rank is a replica already); set zero.stage: 1, 2 or 3"
            )
        return self

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_is_an_int(cls, stage: Any) -> Any:
        # Literal[0, 1, 2, 3] alone would take YAML `true` as stage 1 and `3.0` as stage 3.
        if isinstance(stage, bool | float):
            raise ValueError(f"{stage!r} is not allowed; allowed values: 0, 1, 2, 3")
        return stage


TpStyle = Literal["colwise", "rowwise", "vocab"]


class TpLayer(_Section):
    """How one layer (or every layer a glob matches) is split over the tensor-parallel ranks."""

    style: TpStyle = Field(
        description="colwise: a Linear's output features split (its input all-reduced in "
        "backward); rowwise: its input features split, its output all-reduced; vocab: an "
        "Embedding's or output head's vocabulary split (lookups all-reduced; logits gathered)"
    )
    fused: int = Field(
        1,
        ge=1,
        description="colwise: the output features are this many blocks side by side (q, k and "
        "v in one Linear: 3), each split alike, so every rank holds whole heads of each",
    )

    @model_validator(mode="after")
    def _fused_is_colwise(self) -> TpLayer:
        if self.fused > 1 and self.style != "colwise":
            raise ValueError(f"fused: {self.fused} splits blocks of output features: colwise only")
        return self


class ParallelConfig(_Section):
    """The ranks' mesh beyond ZeRO: tensor parallelism over ``tp`` ranks (Megatron-style)."""

    dp: int | None = Field(
        None, ge=1, description="data-parallel ranks (world size / tp); checked when given"
    )
    tp: int = Field(
        1, ge=1, description="tensor-parallel ranks: each layer of tp_layers is split over them"
    )
    tp_layers: dict[str, TpStyle | TpLayer] = Field(
        default_factory=dict,
        description="module FQN globs ('*' within a dotted name's component, '**' across "
        "dots, e.g. 'transformer.h.*.mlp.c_fc') -> style "
        "(colwise, rowwise, vocab) or {style, fused}; every glob must match a module",
    )

    sequence_parallel: bool = Field(
        False,
        description="between the tp layers (norms, dropout, residual adds) each tp rank holds "
        "its chunk of the sequence: rowwise outputs reduce-scattered and colwise inputs "
        "all-gathered along it (Megatron's sequence parallelism); activations there 1/tp",
    )
    sequence_dim: int = Field(
        -2,
        le=-1,
        description="the activations' sequence dimension, counted from the end: -2 for "
        "[batch, sequence, hidden], -3 for [sequence, batch, hidden]",
    )

    @model_validator(mode="after")
    def _sequence_is_split_by_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the sequence over the tp ranks: set tp > 1")
        return self

    @model_validator(mode="after")
    def _tp_names_layers(self) -> ParallelConfig:
        if self.tp > 1 and not self.tp_layers:
            raise ValueError(
                f"tp: {self.tp} splits the layers named in tp_layers, and it names none; e.g. "
                "tp_layers: {'*.attn.c_attn': {style: colwise, fused: 3}, '*.attn.c_proj': "
                "rowwise, '*.mlp.c_fc': colwise, '*.mlp.c_proj': rowwise}"
            )
        return self

    def layers(self) -> dict[str, TpLayer]:
        """``tp_layers`` with every style spelled out as a TpLayer."""
        return {
            glob: TpLayer(style=layer) if isinstance(layer, str) else layer
            for glob, layer in self.tp_layers.items()
        }


class UnitsConfig(_Section):
    """How parameters are grouped into FSDP units (gathered, freed and reduced together)."""

    classes: list[str] = Field(
        default_factory=list,
        description="every module whose class name is listed becomes one FSDP unit, "
        "innermost first",
    )
    modules: list[str] = Field(
        default_factory=list,
        description="globs over module FQNs, e.g. 'transformer.h.*' (every block) or "
        "'transformer.h.[0-3]'; '*' stops at dots, '**' crosses them",
    )
    min_mb: float | None = Field(
        None,
        gt=0,
        description="size-based wrapping: a module whose not-yet-assigned parameters reach this "
        "many MB becomes a unit, bottom-up",
    )
    keep_gathered: list[str] = Field(
        default_factory=list,
        description="stage 3: globs over unit names ('root' is the root unit; '*' stops at "
        "dots, '**' crosses them) of units "
        "gathered once per step and kept until their last use in backward (no re-gather in "
        "backward), like FSDP2's reshard_after_forward=False",
    )
    keep_gathered_below_mb: float | None = Field(
        None,
        gt=0,
        description="stage 3: units whose gathered parameters are smaller than this many MB are "
        "kept gathered for the step too (DeepSpeed's persistence threshold, per step)",
    )


# The fields each learning-rate schedule reads (any other set field is an error): the first
# three are Hugging Face Trainer's (`lr_scheduler_type`, its `warmup_steps` and
# `num_training_steps`), the rest DeepSpeed's schedulers under their own parameter names.
SCHEDULE_FIELDS: dict[str, tuple[str, ...]] = {
    "constant": ("warmup_steps",),
    "linear": ("warmup_steps", "total_steps", "min_lr"),
    "cosine": ("warmup_steps", "total_steps", "min_lr"),
    "warmup_lr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "warmup_decay_lr": (
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
    ),
    "warmup_cosine_lr": (
        "warmup_min_ratio",
        "warmup_num_steps",
        "warmup_type",
        "cos_min_ratio",
        "total_num_steps",
    ),
}


class ScheduleConfig(_Section):
    """The learning rate per optimizer step (`zerocc.compiler.schedule.lr_at`): a runtime input
    of the program, so a changing rate never recompiles. The position is the count of applied
    steps (a step skipped for an overflow does not advance it, as in DeepSpeed and the Hugging
    Face Trainer), which checkpoints keep."""

    name: Literal[
        "constant", "linear", "cosine", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr"
    ] = Field(
        "constant",
        description="constant, linear, cosine: Hugging Face Trainer's schedules (linear warmup "
        "from 0 over warmup_steps, then constant, or a linear or cosine decay to min_lr at "
        "total_steps); warmup_lr, warmup_decay_lr, warmup_cosine_lr: DeepSpeed's WarmupLR, "
        "WarmupDecayLR and WarmupCosineLR with their parameters and step-for-step values",
    )
    warmup_steps: int = Field(
        0, ge=0, description="constant, linear, cosine: steps of linear warmup from 0 to lr"
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="linear, cosine: the step at which the decay reaches min_lr (required)",
    )
    min_lr: float = Field(
        0.0, ge=0, description="linear, cosine: the rate the decay ends at (< optimizer.lr)"
    )
    warmup_min_lr: float = Field(
        0.0, ge=0, description="warmup_lr, warmup_decay_lr: the rate warmup starts from"
    )
    warmup_max_lr: float | None = Field(
        None,
        gt=0,
        description="warmup_lr, warmup_decay_lr: the rate warmup ends at; default optimizer.lr "
        "(DeepSpeed's WarmupDecayLR defaults to 0.001 whatever the optimizer's rate: a plan has "
        "one peak rate; `zerocc plan import` writes DeepSpeed's value out)",
    )
    warmup_num_steps: int = Field(
        1000, ge=1, description="DeepSpeed's schedules: warmup steps (at least 2 are taken)"
    )
    warmup_type: Literal["log", "linear"] = Field(
        "log", description="DeepSpeed's schedules: the warmup curve, log or linear"
    )
    total_num_steps: int | None = Field(
        None,
        ge=1,
        description="warmup_decay_lr, warmup_cosine_lr: the step the decay ends at (required)",
    )
    warmup_min_ratio: float = Field(
        0.0, ge=0, le=1, description="warmup_cosine_lr: the warmup's start, a fraction of lr"
    )
    cos_min_ratio: float = Field(
        0.0001, ge=0, le=1, description="warmup_cosine_lr: the decay's end, a fraction of lr"
    )

    @model_serializer(mode="wrap")
    def _only_fields_of_this_schedule(self, handler: SerializerFunctionWrapHandler) -> dict:
        # A dumped plan loads again: the other schedules' fields would be errors there.
        return {k: v for k, v in handler(self).items() if k in ("name", *self.fields())}

    def fields(self) -> tuple[str, ...]:
        """The fields this schedule reads (beside ``name``)."""
        return SCHEDULE_FIELDS[self.name]

    @model_validator(mode="after")
    def _fields_of_this_schedule(self) -> ScheduleConfig:
        allowed = self.fields()
        stray = sorted(self.model_fields_set - {"name", *allowed})
        if stray:
            raise ValueError(
                f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to the "
                f"{self.name} schedule; it reads {', '.join(allowed)}"
            )
        total = {"linear": "total_steps", "cosine": "total_steps"}.get(self.name)
        if self.name in ("warmup_decay_lr", "warmup_cosine_lr"):
            total = "total_num_steps"
        if total is not None and getattr(self, total) is None:
            raise ValueError(f"the {self.name} schedule needs {total}: the step its decay ends")
        if total == "total_steps" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps {self.total_steps} must be larger than warmup_steps "
                f"{self.warmup_steps}: the decay runs between them"
            )
        return self


class OptimizerConfig(_Section):
    """The optimizer, applied to each rank's shard of the parameters."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="optimizer, as torch.optim names it")
    lr: float = Field(
        1e-3,
        gt=0,
        description="learning rate, > 0 and at most 1 for adamw (its step moves each weight by "
        "about lr, whatever the gradient's scale: lr > 1 is a typo such as 1e3 for 1e-3) or 10 "
        "for sgd (its step is lr times the gradient; large-batch recipes reach ~3-10)",
        json_schema_extra={"maximum": max(MAX_LR.values())},
    )
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999),
        description="AdamW betas, each in [0, 1) (a moment that keeps all of its past never "
        "forgets its first gradient)",
    )
    eps: float = Field(
        1e-8,
        ge=FP32_TINY,
        description="AdamW epsilon, added to the denominator; at least the smallest normal fp32 "
        "number (1.2e-38): below it, it is a subnormal that GPU kernels flush to 0 (or 0 "
        "itself), and a weight whose gradient is 0 becomes NaN (0/0)",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="decoupled weight decay (AdamW) or L2 (SGD); each step multiplies the "
        "weights by 1 - lr * weight_decay, so lr * weight_decay must be < 1",
    )
    momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="SGD momentum (sgd only), in [0, 1): at 1 or above the momentum buffer "
        "never decays and the steps grow without bound",
    )
    grad_clip: float | None = Field(
        None,
        gt=0,
        description="clip by global L2 norm over all ranks (a finite norm > 0; null: no clipping)",
    )
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig,
        description="learning-rate schedule (default: constant lr); lr is its peak rate",
    )

    @field_validator("lr", mode="wrap")
    @classmethod
    def _lr_in_range(
        cls, lr: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> float:
        # One message for every bad lr, with the range of this plan's optimizer (the field's
        # own bounds are the loosest, those of any optimizer).
        name = info.data.get("name")
        largest = MAX_LR.get(name, max(MAX_LR.values()))
        try:
            value = handler(lr)
        except ValidationError:
            value = None
        allowed = f"allowed: a finite number > 0 and <= {largest:g} for {name or 'any optimizer'}"
        if value is None:
            raise ValueError(f"{show(lr)} is not allowed; {allowed}")
        if value > largest:
            why = {
                "adamw": "an AdamW step moves each weight by about lr",
                "sgd": "an SGD step is lr times the gradient",
            }.get(name, "lr bounds the size of a step")
            raise ValueError(
                f"{show(lr)} is too large: {why}; {allowed} (a dropped minus sign, as in 1e3 "
                "for 1e-3?)"
            )
        return value

    @model_validator(mode="after")
    def _schedule_fits_the_rate(self) -> OptimizerConfig:
        schedule, peak = self.schedule, self.peak_lr
        if schedule.warmup_max_lr is not None and schedule.warmup_max_lr > MAX_LR[self.name]:
            raise ValueError(
                f"schedule.warmup_max_lr {peak:g} is too large for {self.name}: allowed <= "
                f"{MAX_LR[self.name]:g} (as lr)"
            )
        if schedule.name in ("linear", "cosine") and schedule.min_lr >= self.lr:
            raise ValueError(
                f"schedule.min_lr {schedule.min_lr:g} must be below lr {self.lr:g}: the "
                f"{schedule.name} decay runs from lr down to min_lr"
            )
        if schedule.warmup_min_lr > peak:
            raise ValueError(
                f"schedule.warmup_min_lr {schedule.warmup_min_lr:g} is above the rate warmup "
                f"ends at ({peak:g}); allowed: warmup_min_lr <= warmup_max_lr"
            )
        return self

    @property
    def peak_lr(self) -> float:
        """The largest rate the schedule reaches: lr, or DeepSpeed's warmup_max_lr."""
        return self.schedule.warmup_max_lr or self.lr

    @model_validator(mode="after")
    def _decay_keeps_the_weights(self) -> OptimizerConfig:
        shrink = self.peak_lr * self.weight_decay
        if shrink >= 1:
            raise ValueError(
                f"lr {self.peak_lr:g} * weight_decay {self.weight_decay:g} = {shrink:g}: each step "
                "multiplies the weights by 1 - lr * weight_decay, which zeroes or flips them at "
                "1 or more; allowed: lr * weight_decay < 1 (usual weight_decay: 0.01-0.1)"
            )
        return self

    @field_validator("momentum")
    @classmethod
    def _momentum_is_sgd_only(cls, momentum: float, info: ValidationInfo) -> float:
        name = info.data.get("name")
        if momentum != 0 and name == "adamw":
            raise ValueError(
                f"momentum {momentum} applies to sgd only; set optimizer.name: sgd or drop momentum"
            )
        return momentum


Dtype = Literal["fp32", "bf16", "fp16"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleConfig(_Section):
    """Dynamic loss scaling knobs (fp16): the scale backs off on overflow, grows when stable."""

    initial: float = Field(
        2.0**16,
        ge=FP32_TINY,
        le=MAX_LOSS_SCALE,
        description="scale of the first step; a normal fp32 number at most 2^32 (Megatron-LM's "
        "initial scale, the largest used in practice: above it every step overflows until the "
        "scale has backed off)",
    )
    growth_interval: int = Field(
        2000, ge=1, description="steps without overflow after which the scale grows"
    )
    growth_factor: float = Field(
        2.0, gt=1, description="the scale is multiplied by this (finite, > 1) to grow"
    )
    backoff_factor: float = Field(
        0.5, gt=0, lt=1, description="the scale is multiplied by this on overflow, in (0, 1)"
    )
    hysteresis: int = Field(
        2,
        ge=1,
        description="overflowing steps tolerated before the scale backs off (each one is "
        "still skipped); 1 backs off on every overflow, as torch's GradScaler",
    )
    min_scale: float = Field(
        1.0,
        ge=FP32_TINY,
        le=MAX_LOSS_SCALE,
        description="the scale never backs off below this; at most `initial` (a normal fp32 "
        "number: the scale is an fp32 tensor)",
    )

    @model_validator(mode="after")
    def _floor_below_initial(self) -> LossScaleConfig:
        if self.min_scale > self.initial:
            raise ValueError(
                f"min_scale {self.min_scale:g} is above initial {self.initial:g}: the scale "
                "would start below its own floor; allowed: min_scale <= initial"
            )
        return self


class PrecisionConfig(_Section):
    """Mixed precision: compute, reduction and master dtypes, and loss scaling."""

    param: Dtype = Field(
        "fp32", description="compute dtype: parameters are gathered and used in it"
    )
    reduce: Dtype = Field(
        "fp32", description="dtype of gradient reduce-scatter / all-reduce and accumulators"
    )
    master: Dtype = Field(
        "fp32", description="dtype of the weights the optimizer updates (and its states)"
    )
    grad: Dtype | None = Field(
        None,
        description="dtype the gradient shards are kept in between their reduction and the "
        "update, and accumulated in across micro-batches (stages 2-3; stages 0-1 keep the full "
        "gradient in `reduce`, the buffer their collective reduces in place): fp32 or `param`'s "
        "dtype; bf16 with reduce: bf16 gives ZeRO's 2 bytes per parameter, but bf16 "
        "accumulation over micro-batches rounds every addition; default: master's (fp32)",
    )
    buffers: Dtype | None = Field(
        None, description="dtype of floating buffers; default: follow `param`"
    )
    output: Dtype = Field("fp32", description="dtype of the loss the step returns")
    loss_scale: Literal["dynamic", "none"] | float | None = Field(
        None,
        description="'dynamic', a fixed number (a normal fp32 number at most 2^32, as "
        "dynamic.initial), or 'none'; default: dynamic for fp16, else none",
    )
    dynamic: LossScaleConfig = Field(
        default_factory=LossScaleConfig, description="knobs of loss_scale: dynamic"
    )
    on_nonfinite: Literal["error", "skip"] | None = Field(
        None,
        description="what a step whose reduced gradient holds an inf or NaN does, before the "
        "update writes anything: 'error' stops every rank naming the step and the first such "
        "unit; 'skip' skips the step on every rank (counted in skipped_steps); default: skip "
        "under loss scaling (overflow is how the scale backs off), else error",
    )

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _scale_choice(cls, scale: Any) -> Any:
        # Numbers are checked here, not by the union's float: its errors would come once per
        # member of the union ("should be 'dynamic' or 'none'", "should be finite").
        if scale is None or scale in ("dynamic", "none"):
            return scale
        if isinstance(scale, str):  # YAML reads 1e4 (no dot) as a string, as other floats take it
            try:
                scale = float(scale)
            except ValueError:
                pass
        number = isinstance(scale, int | float) and not isinstance(scale, bool)
        if number and FP32_TINY <= scale <= MAX_LOSS_SCALE:  # NaN and inf fail it too
            return float(scale)
        raise ValueError(
            f"{show(scale)} is not allowed; allowed values: 'dynamic', 'none', or a positive "
            f"number from {FP32_TINY:.3g} to 2^32 (finite)"
        )

    @model_validator(mode="after")
    def _consistent(self) -> PrecisionConfig:
        if self.master not in ("fp32", self.param):
            pure = "" if self.param == "fp32" else f" (or {self.param} for pure {self.param})"
            raise ValueError(
                f"master {self.master!r} is lower than param {self.param!r}: the optimizer "
                f"must update weights at least as precise as those used in compute; use "
                f"master: fp32{pure}"
            )
        if self.grad not in (None, "fp32", self.param):
            why = (
                "16-bit gradients come from a 16-bit backward; with param: fp32 use grad: fp32"
                if self.param == "fp32"
                else f"gradients come out of backward in {self.param}, and the other 16-bit "
                "dtype would change their range (fp16 overflows above 65504) or drop mantissa "
                f"bits (bf16 keeps 8) without saving a byte; use grad: {self.param} or fp32"
            )
            raise ValueError(f"grad {self.grad!r} with param {self.param!r}: {why}")
        if self.on_nonfinite == "error" and self.scaling != "none":
            raise ValueError(
                "on_nonfinite: error with loss scaling: an overflowing step is how the scale "
                "learns to back off, so it is skipped; drop on_nonfinite (or set loss_scale: none)"
            )
        if self.param == "fp16" and self.scaling == "none":
            warnings.warn(
                "precision: fp16 compute without loss scaling: small gradients underflow to "
                "zero in fp16; set precision.loss_scale: dynamic",
                PlanWarning,
                stacklevel=2,
            )
        return self

    @property
    def nonfinite(self) -> str:
        """'error' or 'skip' once the default is resolved."""
        if self.on_nonfinite is None:
            return "skip" if self.scaling != "none" else "error"
        return self.on_nonfinite

    @property
    def scaling(self) -> str:
        """'dynamic', 'static' or 'none' once the default is resolved."""
        if self.loss_scale is None:
            return "dynamic" if self.param == "fp16" else "none"
        return "static" if isinstance(self.loss_scale, float) else self.loss_scale

    @property
    def mixed(self) -> bool:
        """Whether the plan leaves fp32 anywhere (the precision pass must run)."""
        dtypes = (
            self.param,
            self.reduce,
            self.master,
            self.grad or self.master,
            self.buffers or self.param,
            self.output,
        )
        return any(d != "fp32" for d in dtypes) or self.scaling != "none"

    def dtype(self, field: str) -> torch.dtype:
        """The torch dtype of ``field`` (``buffers`` resolved to ``param`` when unset, ``grad``
        to ``master``)."""
        name = getattr(self, field) or (self.master if field == "grad" else self.param)
        return DTYPES[name]


class BackendConfig(_Section):
    """Which backend runs the scheduled graph, and on which device."""

    name: str = Field(
        "eager",
        description="the backend that runs the scheduled graph: eager (the reference, op by op), "
        "inductor (the whole program compiled by TorchInductor as one graph, zerocc's ops in "
        "it as scheduled: Triton on a GPU, C++ on a CPU; region by region where it cannot be "
        "whole), inductor-regions (each compute region between zerocc's ops compiled), auto "
        "(inductor-regions on a GPU, eager on a CPU) or one registered with "
        "zerocc.backends.register_backend",
    )
    kernels: Literal["auto", "torch", "fused", "one-pass", "triton"] = Field(
        "auto",
        description="zerocc's own kernels (optimizer update, unscale, pack): torch ops (the "
        "reference), torch's fused optimizer kernels (fused), a CPU update compiled by "
        "Inductor into one loop with its scaling and copy (one-pass: a step on the CPU; the "
        "host updates of offloaded units take it on a GPU machine anyway), or zerocc's Triton "
        "kernels (on CPU only interpreted, with TRITON_INTERPRET=1); auto: triton on a GPU "
        "when triton can run them, else fused, with fp32 masters; torch with lower-precision "
        "masters",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: cuda when this machine has a GPU, else cpu; on cuda, rank i of a "
        "machine runs on cuda:i, and a machine needs a GPU per rank",
    )
    timeout_s: float = Field(
        600,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="seconds a collective may wait for its peers before every rank still "
        "running stops with an error naming the ranks that stopped answering (compilation "
        "does not count against it); > 0 and at most a week (604800)",
    )
    check_memory: bool = Field(
        True,
        description="before training, compare the predicted per-rank peak with the memory "
        "this machine has and stop with the plan changes that would fit; false: go on anyway",
    )


class OverlapConfig(_Section):
    """Hide communication behind compute (the overlap pass): prefetch gathers, delay waits."""

    enabled: bool = Field(
        True, description="run the overlap pass in the default pass list (losses are unchanged)"
    )
    prefetch: int = Field(
        1,
        ge=0,
        description="upper bound on the units whose all-gathers are issued ahead of the unit "
        "being computed (0: gather each unit just before its use)",
    )
    max_inflight_mb: float | None = Field(
        None,
        gt=0,
        description="memory budget of collectives in flight (issued, not yet waited on): "
        "prefetched units and gradient buckets; default: bounded by `prefetch` only",
    )
    bucket_mb: float = Field(
        0,
        ge=0,
        description="consecutive units smaller than this many MB are gathered and reduced in one "
        "collective of up to this size (0: one collective per unit)",
    )


class CostConfig(_Section):
    """Device rates of the cost model behind `zerocc estimate` and the dumps' predicted trace.

    Unset rates come from ``calibration`` (a file `zerocc profile` writes), else from built-in
    defaults for the device."""

    calibration: PathStr | None = Field(
        None,
        description="JSON written by `zerocc profile PLAN`, relative to the plan file",
    )
    compute_tflops: float | None = Field(None, gt=0, description="dense compute rate, TFLOP/s")
    memory_gb_per_s: float | None = Field(
        None, gt=0, description="memory bandwidth of elementwise ops, GB/s"
    )
    link_gbps: float | None = Field(
        None, gt=0, description="per-rank interconnect bandwidth, Gbit/s (e.g. 400 for NDR IB)"
    )
    latency_us: float | None = Field(
        None, ge=0, description="per-hop latency of a collective, microseconds (the alpha term)"
    )
    group_link_gbps: dict[Literal["dp", "replicate", "tp"], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="per mesh group, the link bandwidth of its collectives, Gbit/s (e.g. "
        "{tp: 7200} for NVLink within a node, {replicate: 400} across nodes); the other "
        "groups use link_gbps",
    )


Location = Literal["none", "cpu", "nvme"]


class OffloadConfig(_Section):
    """Where model states live when they do not fit on the device (ZeRO-Offload / -Infinity).

    ``cpu``: host memory (pinned when a GPU is present); ``nvme``: files under ``nvme_path``,
    read and written by background I/O threads. On a CPU-only machine the "device" is host
    memory too: offloaded states are then accounted in their own pool."""

    optimizer: Location = Field(
        "none",
        description="where the fp32 master weights and optimizer moments of offloaded units "
        "live; their update runs there (stages 1-3)",
    )
    params: Location = Field(
        "none",
        description="stage 3: where each offloaded unit's parameter shard lives between its "
        "all-gathers; it is copied in before each gather, scheduled like a prefetch",
    )
    ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the share of the model's parameters (whole units, those whose gradients "
        "are complete first) that are offloaded; 1: every unit",
    )
    defer_updates: Literal["none", "next_forward", "delayed"] = Field(
        "none",
        description="when the host updates of offload.optimizer: cpu run. 'none': at the end "
        "of the step, which waits for them. 'next_forward': each unit's update runs on a host "
        "thread beside the next step's forward, which waits for it only right before the "
        "unit's weights are first read (stages 1-2 all-gather them then): the same numbers as "
        "'none'. 'delayed' (ZeRO-Offload's delayed parameter update): beside the next step's "
        "forward and backward, its weights first used a step later: the gradients of offloaded "
        "units are one step stale (numerics change). A save, state_dict or evaluate applies "
        "the update in flight first (under stages 1-2, an all-gather: on every rank). "
        "next_forward with one micro-batch per step",
    )
    grads: Literal["cpu", "device"] = Field(
        "cpu",
        description="where the reduced gradient shards of units whose optimizer is offloaded "
        "wait for their update, which runs after the step's last one is reduced (the overflow "
        "check and clipping read them all). 'cpu': copied to host buffers as backward reduces "
        "them (each checked for inf/NaN then), leaving the device as they go (see "
        "grads_in_flight): host memory of every shard (4 bytes per element in fp32), as "
        "DeepSpeed's and FSDP2's offload hold. 'device': they stay on the device (its memory, "
        "as without offload) and each is copied, right before its update, through one of two "
        "host buffers, the next one's copy running beside the update: host memory of two "
        "units' shards, for host memory equal to the states. offload.defer_updates: none",
    )
    grads_in_flight: int | None = Field(
        2,
        ge=1,
        description="offload.grads: cpu: how many reduced gradients' copies to the host may be "
        "in flight at once. Backward waits for a gradient's copy before the gradient this many "
        "after it is complete (when the copies are slower than backward), so the device holds "
        "at most this many plus the one being completed; each more costs a unit's gradient of "
        "device memory and waits less (zerocc estimate shows the peak and the wait). null: no "
        "bound, backward never waits and the device may hold every offloaded gradient until "
        "its copy is done",
    )
    nvme_path: PathStr | None = Field(
        None,
        description="folder for the state files of nvme offload (a fast local disk; a relative "
        "path is from the working directory); a per-run subfolder is created there and removed "
        "at exit",
    )

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded."""
        return self.optimizer != "none" or self.params != "none"

    def updates_on_host(self, device: torch.device) -> bool:
        """Whether optimizer updates run on the host beside the ``device`` that computes: the
        optimizer is offloaded and the device is a GPU (on a CPU they are the same processor).
        Such a run picks (and compiles) the host update's kernel set and times the host link."""
        return self.optimizer != "none" and device.type == "cuda"

    @property
    def uses_nvme(self) -> bool:
        """Whether any state lives in files under ``nvme_path``."""
        return "nvme" in (self.optimizer, self.params)


class RecomputeConfig(_Section):
    """Activation checkpointing (the recompute pass): forward activations of chosen units are
    not kept for backward; their forward runs again right before their backward."""

    units: Literal["none", "all"] | list[str] = Field(
        "none",
        description="'all': every unit but the root (whose forward ends where backward "
        "begins); or globs over unit names, e.g. ['transformer.h.*'] ('*' stops at dots, "
        "'**' crosses them); 'none': keep "
        "every activation",
    )

    @property
    def enabled(self) -> bool:
        """Whether any unit is recomputed."""
        return self.units != "none" and self.units != []


class DumpsConfig(_Section):
    """Files that show what the compiler built and what a run did (see zerocc.inspect.dumps)."""

    dir: PathStr | None = Field(
        None,
        description="folder for per-pass programs (.py, .dot), the measured trace, memory "
        "plots and report.html; ZEROCC_DUMP_DIR overrides it",
    )


class CheckpointConfig(_Section):
    """Checkpoints `zerocc train` saves and resumes from (`TrainStep.save` / `load`): by model
    name, loadable under any world size or stage."""

    dir: PathStr | None = Field(
        None,
        description="folder `zerocc train` saves checkpoints to (step-<n> folders, a 'latest' "
        "file naming the newest): at the end of training, every `every` steps, and on SIGTERM; "
        "none: no saves",
    )
    every: int = Field(
        0, ge=0, description="optimizer steps between saves; 0: only at the end and on SIGTERM"
    )
    keep: int | None = Field(
        3, ge=1, description="newest checkpoints kept in `dir`, older ones deleted; null: all"
    )
    resume: PathStr | None = Field(
        None,
        description="checkpoint to start from: a step-<n> folder, or a folder of them (its "
        "newest); the data goes on where that run stopped",
    )


class MetricsConfig(_Section):
    """What `zerocc train` reports as it trains: the progress line, a JSONL file, TensorBoard,
    and an evaluation loss on the workload's held-back data."""

    every: int = Field(
        1,
        ge=1,
        description="optimizer steps per record: the loss (mean over ranks and the steps since "
        "the last record), learning rate, tokens/s and, on GPUs, MFU and peak memory",
    )
    file: PathStr | None = Field(
        None, description="JSONL file rank 0 appends one record to per `every` steps"
    )
    tensorboard: PathStr | None = Field(
        None,
        description="TensorBoard log folder rank 0 writes the same records to (needs the "
        "tensorboard package: pip install tensorboard)",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="optimizer steps between evaluations (and one at the end) of the loss on "
        "the workload's eval_batches, forward only; 0: none",
    )
    eval_batches: int | None = Field(
        None, ge=1, description="batches per rank an evaluation reads; null: all of them"
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="the device's dense peak TFLOP/s for MFU (default: the datasheet's for "
        "known GPUs in the compute dtype; MFU is not shown where it is unknown)",
    )


# Plan fields each host may set its own way: folders on its own disks, files only rank 0 writes,
# and the workload (its data is each rank's own; its model is held to the other ranks' by their
# agreement on each compiled program). The ranks agree on every other field (Plan.shared_lines).
HOST_LOCAL = frozenset(
    {
        "offload.nvme_path",
        "dumps.dir",
        "checkpoint.dir",
        "checkpoint.resume",
        "metrics.file",
        "metrics.tensorboard",
        "cost.calibration",
        "workload",
        "workload_args",
    }
)


def _shared_lines(value: Any, path: str = "") -> list[str]:
    """``path: value`` lines of a plan's (JSON) fields under ``path``, none of HOST_LOCAL."""
    if path in HOST_LOCAL:
        return []
    if isinstance(value, dict) and value:
        return [line for k, v in value.items() for line in _shared_lines(v, _joined(path, k))]
    return [f"{path}: {value!r}"]


def _joined(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# Fields renamed, by their old dotted names: a plan that uses an old name is read under the new
# one, with a warning that says it. Each old name meant two things: `checkpointing` (recompute,
# or saving?) and `offload.pipeline` (the host updates deferred, or pipeline parallelism?).
RENAMED_FIELDS = {"checkpointing": "recompute", "offload.pipeline": "offload.defer_updates"}


def _read_renamed(data: Any, path: list[str], old: str, new: str) -> Any:
    """``data`` with the field at ``path`` (the rest of ``old``) moved to the last name of
    ``new`` beside it, copying only the mappings on the way (the caller's stay as they were);
    warns that it did."""
    if not isinstance(data, dict) or path[0] not in data:
        return data
    if len(path) > 1:
        inner = _read_renamed(data[path[0]], path[1:], old, new)
        return data if inner is data[path[0]] else {**data, path[0]: inner}
    key = new.rpartition(".")[2]
    if key in data:
        raise ValueError(f"{old}: is the old name of {new}:, and the plan gives both; keep {new}:")
    warnings.warn(
        f"plan: `{old}:` is now `{new}:` (read under the new name for now; rename it)",
        RenamedFieldWarning,
        stacklevel=4,
    )
    renamed = {k: v for k, v in data.items() if k != path[0]}
    renamed[key] = data[path[0]]
    return renamed


class Plan(_Section):
    """A zerocc plan: how to shard, optimize and run one training step."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        for old, new in RENAMED_FIELDS.items():
            data = _read_renamed(data, old.split("."), old, new)
        return data

    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage and world size")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="tensor parallelism beside ZeRO: the mesh's dp × tp and the layers split",
    )
    units: UnitsConfig = Field(
        default_factory=UnitsConfig, description="how parameters are grouped into FSDP units"
    )
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="optimizer and gradient clipping"
    )
    grad_accumulation: int = Field(
        1,
        ge=1,
        description="micro-batches per optimizer step; the gradient is the mean over ranks and "
        "micro-batches",
    )
    precision: PrecisionConfig = Field(
        default_factory=PrecisionConfig, description="dtypes of parameters and gradients"
    )
    backend: BackendConfig = Field(
        default_factory=BackendConfig, description="which backend runs the scheduled graph"
    )
    overlap: OverlapConfig = Field(
        default_factory=OverlapConfig,
        description="overlap of communication with compute: prefetch, budget, buckets",
    )
    cost: CostConfig = Field(
        default_factory=CostConfig, description="device rates of the cost model (estimates)"
    )
    offload: OffloadConfig = Field(
        default_factory=OffloadConfig,
        description="optimizer states and parameters in host memory or on NVMe",
    )
    recompute: RecomputeConfig = Field(
        default_factory=RecomputeConfig,
        description="activation checkpointing: which units' forward is recomputed in backward",
    )
    dumps: DumpsConfig = Field(
        default_factory=DumpsConfig, description="where to write inspection dumps, if anywhere"
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="training checkpoints: where `zerocc train` saves, how often, what it resumes",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="what `zerocc train` records: progress line, JSONL, TensorBoard, eval loss",
    )
    passes: list[str] | None = Field(
        None,
        description="pass list in order; default: every pass the plan's sections turn on "
        "(partition, shard, optimizer always; recompute, precision, overlap and offload when "
        "their sections ask), in the order the passes' contracts allow",
    )
    workload: str | None = Field(
        None,
        description="'module:function' returning a zerocc Workload. It is code: importing and "
        "calling it runs it, as running a training script would. The module is looked up in the "
        "plan file's folder first, then in installed packages (sys.path), never in the current "
        "directory unless it is the plan's folder; a plan given as a dict has no folder, so "
        "installed packages only",
        json_schema_extra={"pattern": _WORKLOAD_SHAPE.pattern},
    )
    workload_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments passed to the workload function"
    )
    seed: int = Field(
        0, description="seed for deterministic initialization of models built on the meta device"
    )

    # Not a field: it is where the plan came from, never something a plan file may set.
    _source: str | None = PrivateAttr(default=None)

    @property
    def source(self) -> str | None:
        """The path the plan was loaded from (None for a dict or Plan); the workload module is
        looked up in its folder first (see zerocc.compiler.workload.load_workload)."""
        return self._source

    def shared_lines(self) -> str:
        """The plan as ``field: value`` lines (the YAML path of each field), every field but
        those a host may set its own way (:data:`HOST_LOCAL`): what the ranks must run alike.
        A learning rate or schedule that differs across ranks changes no compiled program,
        only the numbers each rank's shard is updated by."""
        top = {name for name in HOST_LOCAL if "." not in name}  # workload_args may hold objects
        return "\n".join(_shared_lines(self.model_dump(mode="json", exclude=top)))

    def mesh(self, world_size: int) -> Mesh:
        """The layout of ``world_size`` ranks under this plan (``zero.replicate``,
        ``parallel``); a PlanError when the ranks cannot take it."""
        dp, tp = self.parallel.dp, self.parallel.tp
        if dp is not None and dp * tp != world_size:
            raise PlanError(
                f"parallel: dp {dp} × tp {tp} is {dp * tp} ranks, but the world size is "
                f"{world_size}; allowed: dp × tp = {world_size} (or leave dp out)"
            )
        return Mesh.of(world_size, self.zero.replicate, tp)

    @model_validator(mode="after")
    def _mesh_takes_the_world(self) -> Plan:
        if self.zero.world_size is not None:  # a layout the ranks cannot take is an error now
            self.mesh(self.zero.world_size)
        return self

    @model_validator(mode="after")
    def _kernels_update_fp32_masters(self) -> Plan:
        if self.backend.kernels == "triton" and self.precision.master != "fp32":
            raise ValueError(
                "backend.kernels: triton updates fp32 master weights; precision.master: "
                f"{self.precision.master} needs backend.kernels: torch"
            )
        return self

    @model_validator(mode="after")
    def _keep_gathered_is_stage_3(self) -> Plan:
        units = self.units
        if self.zero.stage != 3 and (units.keep_gathered or units.keep_gathered_below_mb):
            raise ValueError(
                f"units.keep_gathered applies to stage 3 only: stage {self.zero.stage} keeps "
                "every parameter resident; drop it or set zero.stage: 3"
            )
        return self

    @model_validator(mode="after")
    def _offload_fits_the_stage(self) -> Plan:
        offload, stage = self.offload, self.zero.stage
        if offload.optimizer != "none" and stage == 0:
            raise ValueError(
                f"offload.optimizer: {offload.optimizer} needs a sharded optimizer (zero.stage "
                "1, 2 or 3); stage 0 keeps every optimizer state on every rank"
            )
        if offload.params != "none" and stage != 3:
            raise ValueError(
                f"offload.params: {offload.params} needs zero.stage: 3 (stage {stage} keeps "
                "every parameter resident on the device)"
            )
        if offload.uses_nvme and not offload.nvme_path:
            raise ValueError("offload to nvme needs offload.nvme_path: a folder on a local disk")
        # (Against the default, not the fields set: a plan dumped and loaded sets them all.)
        bound_set = offload.grads_in_flight != OffloadConfig.model_fields["grads_in_flight"].default
        if bound_set and (offload.grads != "cpu" or offload.optimizer == "none"):
            raise ValueError(
                "offload.grads_in_flight bounds the copies of offload.grads: cpu (gradients of "
                "an offloaded optimizer copied to the host as backward reduces them); set "
                "offload.optimizer: cpu or nvme with offload.grads: cpu, or drop grads_in_flight"
            )
        if offload.grads == "device":
            if offload.optimizer == "none":
                raise ValueError(
                    "offload.grads: device places the gradients of an offloaded optimizer's "
                    "update, but offload.optimizer is none; set offload.optimizer: cpu or nvme, "
                    "or drop offload.grads"
                )
            if offload.defer_updates != "none":
                raise ValueError(
                    "offload.grads: device needs offload.defer_updates: none (a pipelined update "
                    "reads its gradients in the next step, from host buffers kept for it); "
                    "or set offload.grads: cpu"
                )
        if offload.defer_updates != "none":
            needs = {
                "offload.optimizer: cpu (the update it carries runs in host memory)": (
                    offload.optimizer == "cpu"
                ),
                "grad_accumulation: 1 (a step's first micro-batches would compute on the "
                "weights before the update its last one waits for; 'delayed' takes more)": (
                    self.grad_accumulation == 1 or offload.defer_updates == "delayed"
                ),
            }
            precision = self.precision
            if offload.defer_updates == "delayed" and offload.params == offload.optimizer:
                # No compute copy apart from the weights the update writes (fp32 states and
                # parameters together): the step would read them while the update writes.
                needs["a compute copy apart from the weights the update writes (precision.param "
                      "below precision.master, or offload.params: none)"] = (
                    precision.dtype("param") != precision.dtype("master")
                )  # fmt: skip
            missing = [need for need, met in needs.items() if not met]
            if missing:
                raise ValueError(
                    f"offload.defer_updates: {offload.defer_updates} needs "
                    + "; and ".join(missing)
                    + "; or set offload.defer_updates: none"
                )
        return self

    @field_validator("workload")
    @classmethod
    def _workload_shape(cls, workload: str | None) -> str | None:
        if workload is not None and not _WORKLOAD_SHAPE.match(workload):
            raise ValueError(
                f"{workload!r} is not of the form 'module:function' (e.g. 'workload:workload')"
            )
        return workload


def load_plan(src: str | os.PathLike | dict | Plan) -> Plan:
    """Load and validate a plan from a YAML file path, a dict, or a Plan (returned as is).
    A DeepSpeed config (a ``.json`` file or a dict with DeepSpeed's keys) is converted
    (:mod:`zerocc.compiler.plan.deepspeed.config`; an option zerocc does not support is an error).

    Raises PlanError, naming the file, the YAML path of each bad field, the value and what is
    allowed, for a missing file, bad YAML (a key given twice included), a non-mapping document,
    data nested too deep, or an invalid field.
    """
    if isinstance(src, Plan):
        return src
    where = "plan"
    source = None
    if isinstance(src, dict):
        data: Any = src
    elif isinstance(src, str | os.PathLike):
        source = str(Path(os.fsdecode(src)))
        where = plan_origin(source)
        if "\0" in source:
            raise PlanError(f"{where}: a path cannot contain a NUL byte")
        path = Path(source)
        data = read_json(path, where) if path.suffix == ".json" else _read_yaml(path, where)
    else:
        raise PlanError(f"a plan is a YAML path, a dict or a zerocc.Plan, not {type(src).__name__}")
    try:
        check_shape(data)
    except PlanDataError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if not isinstance(data, dict):
        got = f"{type(data).__name__} {show(data)}"
        raise PlanError(f"{where}: expected a mapping of fields at the top, got {got}")
    if is_deepspeed_config(data):  # a ds_config.json: converted, every key accounted for
        data, _ = plan_from_deepspeed(data, where)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise invalid_plan(where, [describe_error(err, Plan) for err in exc.errors()]) from None
    plan._source = source
    return plan


def _read_yaml(path: Path, where: str) -> Any:
    """The document of the plan file at ``path`` ({} for an empty file)."""
    if not path.is_file():
        raise PlanError(f"{where}: not found" if not path.exists() else f"{where}: not a file")
    try:
        with path.open() as stream:  # a stream, so YAML errors name the file
            data = load_yaml(stream)
    except PlanDataError as exc:
        raise PlanError(f"{where}: invalid YAML: {exc}") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{where}: invalid YAML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{where}: cannot be read: {exc}") from None
    return {} if data is None else data  # an empty file: every default


def plan_json_schema() -> dict:
    """The JSON Schema of plan files, for editors and `zerocc plan schema`."""
    schema = Plan.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
