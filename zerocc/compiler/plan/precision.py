"""The precision section: compute, reduction and master dtypes, and loss scaling."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from zerocc.compiler.plan.base import FP32_TINY, Section, refuse_quoted_numbers
from zerocc.compiler.plan.messages import show
from zerocc.compiler.plan.parallelism import ZeroConfig
from zerocc.errors import PlanWarning

if TYPE_CHECKING:
    import torch

# The largest loss scale: Megatron-LM's initial 2^32 is the largest used in practice; above it
# every step overflows (and is skipped) until the scale has backed off.
MAX_LOSS_SCALE = 2.0**32


Dtype = Literal["fp32", "bf16", "fp16"]
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # (torch's names)


class LossScaleConfig(Section):
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
        le=1000,
        description="overflowing steps tolerated before the scale backs off (each one is "
        "still skipped); 1 backs off on every overflow, as torch's GradScaler; at most 1000 "
        "(more would skip every step of a run before the scale ever backs off)",
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


class Float8Config(Section):
    """float8 matmuls (``precision.matmul: fp8``): the scaling recipe and the layers."""

    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="how values are scaled into float8, torchao's recipes: tensorwise (one "
        "scale per tensor; e4m3 inputs and weights, e5m2 gradients) or rowwise (one scale per "
        "row along the dimension a matmul sums over, e4m3 throughout: more accurate, slower "
        "kernels)",
    )
    layers: list[str] = Field(
        default_factory=list,
        description="globs of the nn.Linear layers (by FQN) computed in float8; each must "
        "match a layer whose in and out features are multiples of 16 (the float8 kernels' "
        "requirement). Empty: every nn.Linear with such features but the model's last (its "
        "output head, whose logits the loss is most sensitive to)",
    )


class PrecisionConfig(Section):
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
    matmul: Literal["param", "fp8"] = Field(
        "param",
        description="what the linear layers multiply in: param (the compute dtype) or fp8 "
        "(float8 with scales, torchao's Float8Linear, for the layers precision.fp8 chooses; "
        "weights and their masters stay as they are)",
    )
    fp8: Float8Config = Field(
        default_factory=Float8Config, description="the recipe and layers of matmul: fp8"
    )
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
        refuse_quoted_numbers(scale)  # (a plan's YAML reads 1e4 as a number already)
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

    def kept_gradient(self, zero: ZeroConfig) -> Dtype:
        """The dtype gradients are kept in for the update (and accumulated in): ``reduce``'s,
        the full gradient a collective reduces in place (stages 0-1), or ``grad``'s for the
        gradient shards (stages 2-3; master's when unset)."""
        return (self.grad or self.master) if zero.shards_gradients else self.reduce

    def dtype(self, field: str) -> torch.dtype:
        """The torch dtype of ``field`` (``buffers`` resolved to ``param`` when unset, ``grad``
        to ``master``)."""
        import torch  # (the plan loads without torch: `zerocc plan check` says its errors first)

        name = getattr(self, field) or (self.master if field == "grad" else self.param)
        return getattr(torch, DTYPE_NAMES[name])
