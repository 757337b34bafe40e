"""The persistent state of a training step: what each rank keeps between steps, and its layout.

One place says which tensors exist for a plan (per unit: the flat parameter or its shard, the
fp32 master weights under mixed precision, the gradient accumulator, the optimizer states; the
step counter and the loss scale), so the passes that create their placeholders and the runtime
that allocates them at compile time cannot disagree.

Under mixed precision ``param`` is the compute copy (e.g. bf16) the gathers move and the forward
reads, and ``master`` holds the weights the optimizer updates (fp32): the whole flat for stage 0,
this rank's shard otherwise. The update writes both. Gradient accumulators are in the
``reduce`` dtype where they are the buffers the collective reduces (full, stages 0-1) and in the
master dtype where they receive reduced shards (stages 2-3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerocc.capture import ModelInfo
from zerocc.ir import (
    GRAD,
    LOSS_SCALE,
    LOSS_SCALE_KEY,
    MASTER,
    OPTIM_STATE,
    PARAM_FULL,
    PARAM_SHARD,
    STEP,
)
from zerocc.materialize import initial_values
from zerocc.plan import OptimizerConfig, Plan, PrecisionConfig
from zerocc.units import Unit

OPTIMIZER_STATES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclass(frozen=True)
class StateSpec:
    """One persistent tensor: its key, role, unit, shape and dtype."""

    key: str
    role: str
    unit: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype


STEP_SPEC = StateSpec("optim.step", STEP, None, (), torch.int64)
LOSS_SCALE_SPEC = StateSpec(LOSS_SCALE_KEY, LOSS_SCALE, None, (), torch.float32)


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of a unit's state: compute copy, master weights, accumulators."""

    param: torch.dtype
    master: torch.dtype
    reduce: torch.dtype

    @classmethod
    def of(cls, unit: Unit, precision: PrecisionConfig | None) -> Dtypes:
        """The plan's dtypes, or the model's own (fp32 layout) when ``precision`` is None."""
        if precision is None:
            return cls(unit.dtype, unit.dtype, unit.dtype)
        return cls(*(precision.dtype(f) for f in ("param", "master", "reduce")))


def optimizer_states(config: OptimizerConfig) -> tuple[str, ...]:
    """Names of the per-shard states the optimizer keeps."""
    if config.name == "sgd" and config.momentum == 0:
        return ()
    return OPTIMIZER_STATES[config.name]


def param_specs(
    unit: Unit, stage: int, precision: PrecisionConfig | None = None
) -> dict[str, StateSpec]:
    """``param`` (stage 3: this rank's shard; else the replicated flat), ``param_shard``
    (stages 1-2: this rank's slice of it), ``master`` (when its dtype differs from ``param``'s:
    the weights the optimizer updates) and ``grad`` (the accumulator: full for stages 0-1, a
    shard for 2-3). Frozen units keep no ``grad``. ``precision=None`` is the model's dtype
    throughout, the layout the shard pass builds before the precision pass retypes it."""
    full, shard = (unit.padded_numel,), (unit.shard_numel,)
    dtypes = Dtypes.of(unit, precision)
    key = unit.key

    def spec(name: str, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> StateSpec:
        return StateSpec(f"{key}.{name}", role, unit.name, shape, dtype)

    specs = {
        "param": spec(
            "param",
            PARAM_SHARD if stage == 3 else PARAM_FULL,
            shard if stage == 3 else full,
            dtypes.param,
        )
    }
    if unit.trainable and stage in (1, 2):
        specs["param_shard"] = spec("param_shard", PARAM_SHARD, shard, dtypes.param)
    if dtypes.master != dtypes.param:
        specs["master"] = spec("master", MASTER, full if stage == 0 else shard, dtypes.master)
    if unit.trainable:
        accumulated = full if stage <= 1 else shard
        specs["grad"] = spec(
            "grad", GRAD, accumulated, dtypes.reduce if stage <= 1 else dtypes.master
        )
    return specs


def optimizer_specs(
    unit: Unit, stage: int, config: OptimizerConfig, precision: PrecisionConfig | None = None
) -> list[StateSpec]:
    """The optimizer states of a trainable unit: of its shard, or of the whole flat (stage 0)."""
    shape = (unit.shard_numel,) if stage >= 1 else (unit.padded_numel,)
    dtype = Dtypes.of(unit, precision).master
    return [
        StateSpec(f"{unit.key}.{name}", OPTIM_STATE, unit.name, shape, dtype)
        for name in optimizer_states(config)
    ]


def state_specs(units: list[Unit], plan: Plan) -> list[StateSpec]:
    """Every persistent tensor of a plan, replicated flat parameters first."""
    stage, config = plan.zero.stage, plan.optimizer
    precision = plan.precision if plan.precision.mixed else None
    specs = [s for u in units for s in param_specs(u, stage, precision).values()]
    specs += [s for u in units if u.trainable for s in optimizer_specs(u, stage, config, precision)]
    if config.name == "adamw":
        specs.append(STEP_SPEC)
    if plan.precision.scaling != "none":
        specs.append(LOSS_SCALE_SPEC)
    return sorted(specs, key=lambda s: s.role != PARAM_FULL)


def allocate_state(
    model: nn.Module,
    model_info: ModelInfo,
    units: list[Unit],
    plan: Plan,
    rank: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every persistent tensor of ``plan`` for ``rank``, keyed as its spec: weights from the
    model's initial values (one unit materialized at a time), everything else zeros (the
    step counter on the CPU), and the model's buffers under their FQNs."""
    specs = state_specs(units, plan)
    weights = (PARAM_FULL, PARAM_SHARD, MASTER)
    state: dict[str, torch.Tensor] = {}
    for unit in units:
        fqns = [p.fqn for p in unit.params]
        flat = unit.flatten(initial_values(model, fqns, plan.seed, device))
        for spec in specs:
            if spec.unit != unit.name or spec.role not in weights:
                continue
            if spec.key.endswith(".param_shard"):  # stages 1-2: a view of the replicated flat
                state[spec.key] = unit.shard_of(state[f"{unit.key}.param"], rank)
                continue
            value = flat if spec.shape == flat.shape else unit.shard_of(flat, rank)
            # A copy (of the shard alone: a view would keep the whole flat alive).
            state[spec.key] = value.to(spec.dtype, copy=True)
    for spec in specs:
        if spec.key not in state:
            on = torch.device("cpu") if spec.role == STEP else device
            state[spec.key] = torch.zeros(spec.shape, dtype=spec.dtype, device=on)
    buffers = [b.fqn for b in model_info.buffers]
    state.update(initial_values(model, buffers, plan.seed, device))
    return state
