"""The persistent state of a training step: what each rank keeps between steps, and its layout.

The passes that create state declare it (:class:`StateLayout`: per unit the flat parameter or
its shard, the fp32 master weights under mixed precision, the gradient accumulator, the
optimizer states; the step counter and the loss scale), each pass spec's ``declares`` adding to
or re-typing or re-placing what the passes before it declared, and make their placeholders from
it. The layout is an output of compilation: the compiled program carries it, and the runtime
allocates from the same fold of the passes' declarations
(:func:`zerocc.compiler.driver.pass_manager.state_layout`), before any program exists, so that a
checkpoint can load into it.

Under mixed precision ``param`` is the compute copy (e.g. bf16) the gathers move and the forward
reads, and ``master`` holds the weights the optimizer updates (fp32): the whole flat for stage 0,
this rank's shard otherwise. The update writes both.

Gradients persist only to be accumulated over micro-batches: with ``grad_accumulation: 1`` the
reduced gradient goes straight from its collective to the update, a transient of the program,
and no ``grad`` state exists. With accumulation, the accumulators are in the ``reduce`` dtype
where they are the buffers the collective reduces (full, stages 0-1) and in ``precision.grad``
(default: the master dtype) where they receive reduced shards (stages 2-3).

Offload (:class:`Placement`) says where each state lives: on the device, in host memory, or in
a file on NVMe. A unit whose optimizer states live elsewhere than its parameters has a separate
``master`` (also in fp32 training): the update runs on the master where the optimizer states
live, and the compute copy ``param`` is written from it wherever that lives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.materialize import holds_values, initial_shard, initial_values
from zerocc.compiler.plan import OffloadConfig, OptimizerConfig, Plan, PrecisionConfig, ZeroConfig
from zerocc.compiler.plan.optimizers import OPTIMIZERS
from zerocc.compiler.units import Unit
from zerocc.ir.kinds import Role
from zerocc.ir.nodes import (
    GRAD,
    LOSS_SCALE,
    LOSS_SCALE_KEY,
    LR,
    MASTER,
    OPTIM_STATE,
    PARAM_FULL,
    PARAM_SHARD,
    STEP,
)

# Every state each optimizer may keep per element of a unit's shard (the registry's: which it
# keeps depends on its fields, :func:`optimizer_states`).
OPTIMIZER_STATES = {name: kind.all_states for name, kind in OPTIMIZERS.items()}


# Where a persistent tensor lives.
class Location(StrEnum):
    """Where a state tensor lives."""

    DEVICE = "device"  # the compute device (the GPU; on a CPU-only machine, the compute pool)
    HOST = "host"  # host memory (pinned where a GPU copies it): offload to cpu
    NVME = "nvme"  # a file under offload.nvme_path, read into host buffers when needed


DEVICE, HOST, NVME = Location.DEVICE, Location.HOST, Location.NVME
LOCATIONS = (DEVICE, HOST, NVME)
_PLAN_LOCATION = {"none": DEVICE, "cpu": HOST, "nvme": NVME}


@dataclass(frozen=True)
class StateSpec:
    """One persistent tensor: its key, role, unit, shape, dtype and where it lives."""

    key: str
    role: Role
    unit: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    location: Location = DEVICE

    @property
    def is_view(self) -> bool:
        """Stages 1-2's ``param_shard``: a view of the unit's replicated flat, with no memory
        of its own (counted, saved and allocated as part of the flat)."""
        return self.key.endswith(".param_shard")

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Placement:
    """Where one unit's states live: the master weights with the optimizer states (the update
    runs there), and (stage 3) the parameter shard between its all-gathers."""

    optimizer: Location = DEVICE
    params: Location = DEVICE

    @property
    def split(self) -> bool:
        """Whether the optimizer states and the parameters live apart: the update then needs a
        master weight of its own where the states are."""
        return self.optimizer != self.params

    @property
    def offloaded(self) -> bool:
        """Whether anything of the unit lives off the device."""
        return self.optimizer != DEVICE or self.params != DEVICE


def offloaded_units(units: list[Unit], ratio: float) -> list[Unit]:
    """The units ``offload.ratio`` selects: whole units, taken in the reverse of the model's
    parameter order (for a model written in execution order: those whose gradients complete
    first in backward, so their copies have the most backward left to hide behind) until they
    hold ``ratio`` of the parameters."""
    total = sum(u.numel for u in units)
    chosen: list[Unit] = []
    held = 0
    for unit in reversed(units):
        if held >= ratio * total - 1e-9 * total:
            break
        chosen.append(unit)
        held += unit.numel
    return chosen


def placements(units: list[Unit], offload: OffloadConfig) -> dict[str, Placement]:
    """Where each unit's states live under the plan's ``offload`` section."""
    out = {u.name: Placement() for u in units}
    if not offload.enabled:
        return out
    for unit in offloaded_units(units, offload.ratio):
        optimizer = _PLAN_LOCATION[offload.optimizer] if unit.trainable else DEVICE
        out[unit.name] = Placement(optimizer, _PLAN_LOCATION[offload.params])
    return out


STEP_SPEC = StateSpec("optim.step", STEP, None, (), torch.int64)
# The rate of the step, set by the runtime before every step from the plan's schedule: a
# program input, so that a changing rate never recompiles (fp64, as the schedulers compute it).
LR_SPEC = StateSpec("optim.lr", LR, None, (), torch.float64)
LOSS_SCALE_SPEC = StateSpec(LOSS_SCALE_KEY, LOSS_SCALE, None, (), torch.float32)


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of a unit's state: compute copy, master weights, reductions, gradient shards."""

    param: torch.dtype
    master: torch.dtype
    reduce: torch.dtype
    grad: torch.dtype  # the gradient shards of stages 2-3 (``precision.grad``)

    @classmethod
    def of(cls, unit: Unit, precision: PrecisionConfig | None) -> Dtypes:
        """The plan's dtypes, or the model's own (fp32 layout) when ``precision`` is None."""
        if precision is None:
            return cls(unit.dtype, unit.dtype, unit.dtype, unit.dtype)
        return cls(*(precision.dtype(f) for f in ("param", "master", "reduce", "grad")))

    def gradient(self, zero: ZeroConfig) -> torch.dtype:
        """The dtype a unit's gradient is kept in for the update (and accumulated in): the
        ``reduce`` dtype of the full gradient the collective reduces in place (stages 0-1),
        ``grad`` for the gradient shards (stages 2-3)."""
        return self.grad if zero.shards_gradients else self.reduce


def optimizer_states(config: OptimizerConfig) -> tuple[str, ...]:
    """Names of the per-shard states the optimizer keeps (SGD's momentum buffer only with
    momentum, RMSprop's gradient average only when centered, ...)."""
    return config.kind.states_of(config.hyper())


def param_specs(
    unit: Unit,
    zero: ZeroConfig,
    precision: PrecisionConfig | None = None,
    grad_accumulation: int = 1,
) -> dict[str, StateSpec]:
    """``param`` (stage 3: this rank's shard; else the replicated flat), ``param_shard``
    (stages 1-2: this rank's slice of it), ``master`` (the weights the optimizer updates, when
    their dtype differs from ``param``'s) and, when gradients are accumulated over micro-batches
    (``grad_accumulation`` > 1), ``grad`` (the accumulator: full for stages 0-1, a shard for
    2-3). Frozen units keep no ``grad``. ``precision=None`` is the model's dtype throughout, the
    layout the shard pass declares before the precision pass retypes it. All on the device:
    offload re-places them (:func:`place_unit`)."""
    full, shard = (unit.padded_numel,), (unit.shard_numel,)
    dtypes = Dtypes.of(unit, precision)

    def spec(name: str, role: Role, shape: tuple[int, ...], dtype: torch.dtype) -> StateSpec:
        return StateSpec(f"{unit.key}.{name}", role, unit.name, shape, dtype)

    specs = {
        "param": spec(
            "param",
            PARAM_SHARD if zero.shards_params else PARAM_FULL,
            shard if zero.shards_params else full,
            dtypes.param,
        )
    }
    if unit.trainable and zero.shards_optimizer and not zero.shards_params:
        specs["param_shard"] = spec("param_shard", PARAM_SHARD, shard, dtypes.param)
    if dtypes.master != dtypes.param:
        specs["master"] = spec(
            "master", MASTER, shard if zero.shards_optimizer else full, dtypes.master
        )
    if unit.trainable and grad_accumulation > 1:
        accumulated = shard if zero.shards_gradients else full
        specs["grad"] = spec("grad", GRAD, accumulated, dtypes.gradient(zero))
    return specs


def optimizer_specs(
    unit: Unit, zero: ZeroConfig, config: OptimizerConfig, precision: PrecisionConfig | None = None
) -> list[StateSpec]:
    """The optimizer states of a trainable unit: of its shard, or of the whole flat (stage 0)."""
    shape = (unit.shard_numel,) if zero.shards_optimizer else (unit.padded_numel,)
    dtype = Dtypes.of(unit, precision).master
    return [
        StateSpec(f"{unit.key}.{name}", OPTIM_STATE, unit.name, shape, dtype)
        for name in optimizer_states(config)
    ]


class StateLayout:
    """The persistent state a compiled step binds: every :class:`StateSpec` by key, in the
    order the passes declared them. :meth:`declare` adds a spec, or replaces the one of its key
    in place (a retype, a move to host memory)."""

    def __init__(self, specs: tuple[StateSpec, ...] | list[StateSpec] = ()) -> None:
        self._specs: dict[str, StateSpec] = {s.key: s for s in specs}

    def declare(self, spec: StateSpec) -> None:
        """Add ``spec``, or replace the spec of its key."""
        self._specs[spec.key] = spec

    def __getitem__(self, key: str) -> StateSpec:
        return self._specs[key]

    def get(self, key: str) -> StateSpec | None:
        """The spec of ``key``, or None."""
        return self._specs.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._specs

    def __iter__(self) -> Iterator[StateSpec]:
        return iter(list(self._specs.values()))

    def __len__(self) -> int:
        return len(self._specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateLayout) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"StateLayout({len(self)} states: {', '.join(self._specs)})"

    def of_unit(self, unit: Unit) -> dict[str, StateSpec]:
        """The unit's states by their name within it (``param``, ``master``, ``exp_avg``...)."""
        prefix = f"{unit.key}."
        return {k.removeprefix(prefix): s for k, s in self._specs.items() if s.unit == unit.name}

    def at(self, location: Location) -> list[StateSpec]:
        """The states that live at ``location``."""
        return [s for s in self._specs.values() if s.location == location]

    def difference(self, other: StateLayout) -> str:
        """The first few keys on which two layouts differ, said for an error message."""
        keys = dict.fromkeys([*self._specs, *other._specs])
        differing = [k for k in keys if self.get(k) != other.get(k)]
        return "; ".join(f"{k}: {self.get(k)} vs {other.get(k)}" for k in differing[:3])


def captured_state(plan: Plan) -> StateLayout:
    """The state capture binds before any pass: the loss scale, under loss scaling."""
    return StateLayout([LOSS_SCALE_SPEC] if plan.precision.scaling != "none" else [])


def declare_params(
    layout: StateLayout, units: list[Unit], plan: Plan, precision: PrecisionConfig | None
) -> None:
    """Declare (or retype, with ``precision``) every unit's parameter states."""
    for unit in units:
        for spec in param_specs(unit, plan.zero, precision, plan.grad_accumulation).values():
            layout.declare(spec)


def declare_optimizer_state(layout: StateLayout, units: list[Unit], plan: Plan) -> None:
    """Declare each trainable unit's optimizer states, the step's learning rate and (an
    optimizer that counts its steps: AdamW's bias corrections, ...) the step counter."""
    precision = plan.precision if plan.precision.mixed else None
    for unit in units:
        if unit.trainable:
            for spec in optimizer_specs(unit, plan.zero, plan.optimizer, precision):
                layout.declare(spec)
    layout.declare(LR_SPEC)
    if plan.optimizer.kind.counts_steps_of(plan.optimizer.hyper()):
        layout.declare(STEP_SPEC)


def declare_placements(layout: StateLayout, units: list[Unit], plan: Plan) -> None:
    """Move the states of the units ``offload`` selects to where it places them."""
    where = placements(units, plan.offload)
    for unit in units:
        if where[unit.name].offloaded:
            place_unit(layout, unit, where[unit.name], plan.zero)


def place_unit(layout: StateLayout, unit: Unit, placement: Placement, zero: ZeroConfig) -> None:
    """Move a unit's declared states to where ``placement`` puts them: master weights and
    optimizer states with the optimizer, the parameter (or its shard) with the parameters. A
    trainable unit whose optimizer lives apart from its parameters gets a master weight where
    the optimizer is, in the parameter's dtype (an fp32 plan has none otherwise): the update
    runs there."""
    for name, spec in layout.of_unit(unit).items():
        if spec.role in (MASTER, OPTIM_STATE):
            layout.declare(replace(spec, location=placement.optimizer))
        elif name == "param":
            layout.declare(replace(spec, location=placement.params))
    key = f"{unit.key}.master"
    if unit.trainable and placement.split and key not in layout:
        shape = (unit.shard_numel,) if zero.shards_optimizer else (unit.padded_numel,)
        dtype = layout[f"{unit.key}.param"].dtype
        layout.declare(StateSpec(key, MASTER, unit.name, shape, dtype, placement.optimizer))


def _initial_flat(
    model: nn.Module,
    unit: Unit,
    seed: int,
    device: torch.device,
    from_rank_0: Callable[[torch.Tensor], None] | None,
    split: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """The unit's full flat initial weights (this rank's slices of them, ``split``), rank 0's
    where the model holds values (see :func:`allocate_state`)."""
    fqns = [p.fqn for p in unit.params]
    values = initial_values(model, fqns, seed, device)
    broadcast = from_rank_0 is not None and holds_values(model, fqns)
    if split is None:
        flat = unit.flatten(values)
        if broadcast:
            from_rank_0(flat)
        return flat
    if broadcast:
        values = {f: v.contiguous().clone() for f, v in values.items()}  # not the model's
        for value in values.values():
            from_rank_0(value)
    return unit.flatten(split(values))


def allocate_state(
    model: nn.Module,
    model_info: ModelInfo,
    units: list[Unit],
    layout: StateLayout,
    seed: int,
    shard_rank: Callable[[Unit], int],
    device: torch.device,
    empty: Callable[[StateSpec], torch.Tensor],
    store: Any = None,
    from_rank_0: Callable[[torch.Tensor], None] | None = None,
    split: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every resident persistent tensor of ``layout`` for the rank that holds shard
    ``shard_rank(unit)`` of each unit, keyed as its spec, in the
    memory ``empty`` gives it (where its spec places it; an NVMe state's host tensor is written
    to its file): weights from the model's initial values (one unit materialized at a time),
    everything else zeros (the step counter and the learning rate on the CPU), and the model's
    buffers under their FQNs. States placed on NVMe are written to ``store`` (a
    :class:`zerocc.runtime.nvme.NvmeStore`) instead of being returned.

    Every rank starts from rank 0's weights and buffers, as DDP does: ``from_rank_0(t)``
    (a broadcast) overwrites a unit's full flat, before it is sharded, and each buffer, with
    rank 0's values whenever the model holds real values for them (ranks seeded differently
    would otherwise train a mix of their starting points). Tensors on the ``meta`` device are
    initialized from ``seed`` (the plan's) and their own name, the same on every rank, so they need
    no broadcast. ``split`` (tensor and expert parallelism) gives this rank's slices of full
    values: rank 0's full values are broadcast before they are split."""
    specs = list(layout)
    weights = (PARAM_FULL, PARAM_SHARD, MASTER)
    state: dict[str, torch.Tensor] = {}

    def place(spec: StateSpec, value: torch.Tensor | None) -> None:
        tensor = empty(spec)
        if value is None:
            tensor.zero_()
        else:
            tensor.copy_(value)  # a copy (of the shard alone: a view keeps the whole flat alive)
        if spec.location == NVME:
            store.write(spec.key, tensor).wait()
        else:
            state[spec.key] = tensor

    for unit in units:
        rank = shard_rank(unit)
        unit_specs = [s for s in specs if s.unit == unit.name and s.role in weights]
        # Weight files give a unit that is only ever sharded (stage 3) this rank's shard alone.
        shard = flat = None
        if split is None and all(s.is_view or s.shape == (unit.shard_numel,) for s in unit_specs):
            shard = initial_shard(model, unit, rank, device)
        if shard is None:
            flat = _initial_flat(model, unit, seed, device, from_rank_0, split)
            shard = unit.shard_of(flat, rank)
        for spec in unit_specs:
            if spec.is_view:
                state[spec.key] = unit.shard_of(state[f"{unit.key}.param"], rank)
                continue
            place(spec, shard if spec.shape == shard.shape else flat)
    for spec in specs:
        if spec.key in state or spec.role in weights:
            continue
        if spec.role in (STEP, LR):  # scalars the runtime sets: on the CPU
            state[spec.key] = torch.zeros(spec.shape, dtype=spec.dtype)
        else:
            place(spec, None)
    buffers = initial_values(model, [b.fqn for b in model_info.buffers], seed, device)
    for fqn, value in buffers.items():
        if from_rank_0 is not None and holds_values(model, [fqn]):
            buffers[fqn] = value = value.contiguous()
            from_rank_0(value)
    state.update(buffers)
    return state
