"""The optimizer section: the optimizer, its learning rate and the rate's schedule."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from zerocc.compiler.plan.base import FP32_TINY, Section, refuse_quoted_numbers
from zerocc.compiler.plan.messages import show
from zerocc.compiler.plan.muon import NS_COEFFICIENTS, NS_STEPS, ParamGroup
from zerocc.compiler.plan.optimizers import (
    COMMON_FIELDS,
    OPTIMIZERS,
    OptimizerKind,
    readers_of,
    stray_fields,
)

Beta = Annotated[float, Field(ge=0, lt=1)]


# The largest learning rate per optimizer. AdamW moves each weight by about lr per step whatever
# the gradient's scale (its update is normalized, as every optimizer's here but SGD's), so
# lr > 1 moves every weight by more than its own size each step: what `lr: 1e3` meaning 1e-3 (a
# dropped minus sign) looks like. An SGD step is lr times the gradient, whose scale is the
# loss's: large-batch recipes reach lr ~3-10.
MAX_LR = {name: kind.max_lr for name, kind in OPTIMIZERS.items()}
# The optimizers' names, as the plan's ``optimizer.name`` takes them (the registry's order).
OptimizerName = Literal[tuple(OPTIMIZERS)]  # type: ignore[valid-type]
Fraction = Annotated[float, Field(ge=0, lt=1)]

# The largest AdamW epsilon: eps is added to the root of the second moment, so a step moves a
# weight by about lr * gradient / eps once eps outweighs the gradient's scale; recipes use
# 1e-8 to 1e-6, and 1 (TensorFlow's advice for Inception) is the largest in use. Above it the
# update shrinks toward nothing (1e300 is inf in fp32: no weight moves at all).
MAX_EPS = 1.0

# The most optimizer steps a schedule may count (warmup, decay): a billion steps, 31 years at a
# step a second; a schedule longer than any run is a typo (warmup_steps: 1e15 warms up forever,
# its rate within 1e-15 of 0 through any run).
MAX_STEPS = 10**9


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


class ScheduleConfig(Section):
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
        0,
        ge=0,
        le=MAX_STEPS,
        description="constant, linear, cosine: steps of linear warmup from 0 to lr (at most "
        "10^9, more steps than any run takes)",
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="linear, cosine: the step at which the decay reaches min_lr (required; at "
        "most 10^9)",
    )
    min_lr: float = Field(
        0.0, ge=0, description="linear, cosine: the rate the decay ends at (< optimizer.lr)"
    )
    warmup_min_lr: float = Field(
        0.0, ge=0, description="warmup_lr, warmup_decay_lr: the rate warmup starts from"
    )
    warmup_max_lr: float | None = Field(
        None,
        ge=FP32_TINY,
        description="warmup_lr, warmup_decay_lr: the rate warmup ends at, as lr at least the "
        "smallest normal fp32 number (1.2e-38: below it the update's rate is 0); default "
        "optimizer.lr "
        "(DeepSpeed's WarmupDecayLR defaults to 0.001 whatever the optimizer's rate: a plan has "
        "one peak rate; `zerocc plan import` writes DeepSpeed's value out)",
    )
    warmup_num_steps: int = Field(
        1000,
        ge=1,
        le=MAX_STEPS,
        description="DeepSpeed's schedules: warmup steps (at least 2 are taken; at most 10^9)",
    )
    warmup_type: Literal["log", "linear"] = Field(
        "log", description="DeepSpeed's schedules: the warmup curve, log or linear"
    )
    total_num_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="warmup_decay_lr, warmup_cosine_lr: the step the decay ends at (required; "
        "at most 10^9)",
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


class OptimizerConfig(Section):
    """The optimizer, applied to each rank's shard of the parameters. Each optimizer reads its
    own fields (as torch.optim names them; :mod:`zerocc.compiler.plan.optimizers` lists which)
    beside name, lr, grad_clip and schedule: a field of another optimizer is an error, and a
    field left out takes torch's default for this optimizer."""

    name: OptimizerName = Field(
        "adamw",
        description="optimizer, as torch.optim names it (lowercase): "
        + ", ".join(OPTIMIZERS)
        + "; lion is Chen et al.'s (2023), not in torch.optim",
    )
    lr: float = Field(
        1e-3,
        gt=0,
        description="learning rate, > 0 and at most 10 for sgd (its step is lr times the "
        "gradient; large-batch recipes reach ~3-10) or 1 for the others (their step moves each "
        "weight by about lr, whatever the gradient's scale: lr > 1 is a typo such as 1e3 for "
        "1e-3); default torch's: 1e-3, 1e-2 for adagrad and rmsprop, 2e-3 for nadam and adamax, "
        "1e-4 for lion",
        json_schema_extra={"maximum": max(MAX_LR.values())},
    )
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999),
        description="adamw, adam, nadam, radam, adamax, lion: the moments' betas, each in "
        "[0, 1) (a moment that keeps all of its past never forgets its first gradient); lion's "
        "default (0.9, 0.99)",
    )
    eps: float = Field(
        1e-8,
        ge=FP32_TINY,
        le=MAX_EPS,
        description="adamw, adam, adagrad, rmsprop, nadam, radam, adamax: epsilon, added to the "
        "denominator (default 1e-8; adagrad's 1e-10); at least the smallest normal fp32 "
        "number (1.2e-38): below it, it is a subnormal that GPU kernels flush to 0 (or 0 "
        "itself), and a weight whose gradient is 0 becomes NaN (0/0); at most 1: the step is "
        "about lr * gradient / eps once eps outweighs the gradients, and shrinks toward nothing "
        "above it (1e300 is inf in fp32, and no weight moves)",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="every optimizer: decoupled weight decay (adamw, lion; nadam and radam "
        "with decoupled_weight_decay) or L2 (the others); each step multiplies the weights by "
        "about 1 - lr * weight_decay, so lr * weight_decay must be < 1",
    )
    momentum: Fraction = Field(
        0.0,
        description="sgd, rmsprop: momentum, in [0, 1): at 1 or above the momentum buffer "
        "never decays and the steps grow without bound (0: no buffer is kept)",
    )
    dampening: Fraction = Field(
        0.0, description="sgd: dampening of the momentum, in [0, 1) (torch's default 0)"
    )
    nesterov: bool = Field(
        False, description="sgd: Nesterov momentum (needs momentum > 0 and dampening 0)"
    )
    amsgrad: bool = Field(
        False, description="adam: AMSGrad, keeping the largest second moment (one more state)"
    )
    lr_decay: float = Field(
        0.0, ge=0, description="adagrad: the rate is lr / (1 + (step - 1) * lr_decay)"
    )
    initial_accumulator_value: float = Field(
        0.0, ge=0, description="adagrad: the sum of squared gradients starts at this value"
    )
    alpha: Fraction = Field(
        0.99,
        description="rmsprop: smoothing of the squared-gradient average, in [0, 1) (at 1 the "
        "average never moves from 0)",
    )
    centered: bool = Field(
        False,
        description="rmsprop: divide by the gradient's variance estimate (keeps the gradient's "
        "average too: one more state)",
    )
    momentum_decay: float = Field(
        4e-3, ge=0, description="nadam: the momentum's decay (torch's psi, default 4e-3)"
    )
    decoupled_weight_decay: bool = Field(
        False,
        description="nadam, radam: weight decay decoupled as AdamW's (NAdamW, RAdamW) instead "
        "of L2",
    )
    ns_coefficients: tuple[float, float, float] = Field(
        NS_COEFFICIENTS, description="muon: the Newton-Schulz polynomial's (a, b, c)"
    )
    ns_steps: int = Field(
        NS_STEPS, ge=1, le=99, description="muon: Newton-Schulz steps (torch allows up to 99)"
    )
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = Field(
        None,
        description="muon: each matrix's rate, lr * sqrt(max(1, rows/cols)) (original, the "
        "default) or lr * 0.2 * sqrt(max(rows, cols)) (match_rms_adamw, Moonlight's)",
    )
    groups: list[ParamGroup] = Field(
        default_factory=list,
        description="muon: which parameters take muon and which adamw (with their own lr, "
        "betas, eps, weight_decay), by glob; the first group a parameter matches decides; "
        "others: 2-D hidden matrices muon, embeddings, the output head, norms, biases adamw",
    )
    grad_clip: float | None = Field(
        None,
        ge=FP32_TINY,
        description="clip by global L2 norm over all ranks (a finite norm of at least the "
        "smallest normal fp32 number, 1.2e-38: below it the clip coefficient, computed in fp32, "
        "is 0 and every gradient is zeroed; null: no clipping)",
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
        refuse_quoted_numbers(lr)
        try:
            value = handler(lr)
        except ValidationError:
            value = None
        allowed = (
            f"allowed: a finite number from {FP32_TINY:.3g} to {largest:g} for "
            f"{name or 'any optimizer'}"
        )
        if value is None:
            raise ValueError(f"{show(lr)} is not allowed; {allowed}")
        if value < FP32_TINY:
            raise ValueError(
                f"{show(lr)} is too small: the update applies it in fp32, where it is 0 or a "
                f"subnormal that kernels flush to 0, and nothing trains; {allowed}"
            )
        if value > largest:
            kind = OPTIMIZERS.get(name)
            why = kind.lr_why if kind is not None else "lr bounds the size of a step"
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

    @model_validator(mode="wrap")
    @classmethod
    def _defaults_of_this_optimizer(
        cls, data: Any, handler: ModelWrapValidatorHandler[OptimizerConfig]
    ) -> OptimizerConfig:
        # The fields left out take torch's defaults for this optimizer (Adagrad's lr 1e-2 and
        # eps 1e-10, Lion's betas (0.9, 0.99), ...), checked as given ones are; they stay
        # unset (model_fields_set): the Trainer's and Lightning's arguments fill what the plan
        # did not set, and a default is no setting of the user's.
        filled: list[str] = []
        name = data.get("name", "adamw") if isinstance(data, dict) else None
        kind = OPTIMIZERS.get(name) if isinstance(name, str) else None
        if kind is not None:
            filled = [f for f in kind.defaults if f not in data]
            data = {**{f: kind.defaults[f] for f in filled}, **data}
        config = handler(data)
        config.__pydantic_fields_set__.difference_update(filled)
        return config

    @model_validator(mode="after")
    def _fields_of_this_optimizer(self) -> OptimizerConfig:
        # A field of another optimizer would be ignored: an error naming this one's fields.
        stray = stray_fields(self.name, set(self.model_fields_set))
        if stray:
            readers = "; ".join(
                f"{f} is read by {', '.join(readers_of(f))}" for f in stray if readers_of(f)
            )
            raise ValueError(
                f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to "
                f"{self.name}; it reads {', '.join((*COMMON_FIELDS[1:], *self.kind.fields))}"
                + (f" ({readers})" if readers else "")
            )
        return self

    @model_serializer(mode="wrap")
    def _only_fields_of_this_optimizer(self, handler: SerializerFunctionWrapHandler) -> dict:
        # A dumped plan loads again: the other optimizers' fields would be errors there.
        keep = {*COMMON_FIELDS, *self.kind.fields}
        return {k: v for k, v in handler(self).items() if k in keep}

    @property
    def kind(self) -> OptimizerKind:
        """This optimizer's registry entry: its fields, states and step count."""
        return OPTIMIZERS[self.name]

    def hyper(self) -> dict[str, Any]:
        """This optimizer's own fields and their values (beside lr, grad_clip, schedule)."""
        return {f: getattr(self, f) for f in self.kind.fields}

    @model_validator(mode="after")
    def _nesterov_has_momentum(self) -> OptimizerConfig:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD), not momentum "
                f"{self.momentum:g} and dampening {self.dampening:g}"
            )
        return self
