"""The persistent state of a training step: what each rank keeps between steps, and its layout.

One place says which tensors exist for a plan (per unit: the flat parameter or its shard, the
gradient accumulator, the optimizer states; the step counter), so the passes that create their
placeholders and the runtime that allocates them at compile time cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerocc.ir import GRAD, OPTIM_STATE, PARAM_FULL, PARAM_SHARD, STEP
from zerocc.plan import OptimizerConfig
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


def optimizer_states(config: OptimizerConfig) -> tuple[str, ...]:
    """Names of the per-shard states the optimizer keeps."""
    if config.name == "sgd" and config.momentum == 0:
        return ()
    return OPTIMIZER_STATES[config.name]


def param_specs(unit: Unit, stage: int) -> dict[str, StateSpec]:
    """``param`` (stage 3: this rank's shard; else the replicated flat), ``param_shard``
    (stages 1-2: this rank's slice of it, which the optimizer updates) and ``grad`` (the
    accumulator: full for stages 0-1, a shard for 2-3). Frozen units keep only ``param``."""
    full, shard = (unit.padded_numel,), (unit.shard_numel,)
    specs = {
        "param": StateSpec(
            f"{unit.key}.param",
            PARAM_SHARD if stage == 3 else PARAM_FULL,
            unit.name,
            shard if stage == 3 else full,
            unit.dtype,
        )
    }
    if unit.trainable and stage in (1, 2):
        specs["param_shard"] = StateSpec(
            f"{unit.key}.param_shard", PARAM_SHARD, unit.name, shard, unit.dtype
        )
    if unit.trainable:
        specs["grad"] = StateSpec(
            f"{unit.key}.grad", GRAD, unit.name, full if stage <= 1 else shard, unit.dtype
        )
    return specs


def optimizer_specs(unit: Unit, stage: int, config: OptimizerConfig) -> list[StateSpec]:
    """The optimizer states of a trainable unit: of its shard, or of the whole flat (stage 0)."""
    shape = (unit.shard_numel,) if stage >= 1 else (unit.padded_numel,)
    return [
        StateSpec(f"{unit.key}.{name}", OPTIM_STATE, unit.name, shape, unit.dtype)
        for name in optimizer_states(config)
    ]


def state_specs(units: list[Unit], stage: int, config: OptimizerConfig) -> list[StateSpec]:
    """Every persistent tensor of a plan, replicated flat parameters first."""
    specs = [s for u in units for s in param_specs(u, stage).values()]
    specs += [s for u in units if u.trainable for s in optimizer_specs(u, stage, config)]
    if config.name == "adamw":
        specs.append(STEP_SPEC)
    return sorted(specs, key=lambda s: s.role != PARAM_FULL)
