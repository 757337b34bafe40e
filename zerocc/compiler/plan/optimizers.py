"""The optimizers a plan can name: one :class:`OptimizerKind` each, registered in
:data:`OPTIMIZERS`, saying which of the plan's fields it reads (as ``torch.optim`` names them),
their defaults (torch's), the per-element states it keeps (in the order torch's functional form
takes them), whether it counts its steps, and its largest learning rate.

Everything else follows from the entry: the plan's checks (a field of another optimizer is an
error naming this one's), the states the compiler declares and checkpoints save
(:mod:`zerocc.compiler.state`), and which update the optimizer pass emits. An *elementwise*
update (every ``torch.optim`` optimizer here, and Lion) runs on each rank's flat shard as
AdamW's does; an update that needs each parameter whole (``whole_tensors``: Muon, Adafactor's
factored moments) is the optimizer pass's to route to the owner of each tensor. This module is
data (no torch): the plan package imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerocc.compiler.plan.muon import MUON_DEFAULTS, MUON_FIELDS

# The fields every optimizer reads: the optimizer's name, its peak rate, the clip and the
# rate's schedule (the update of each applies them the same way).
COMMON_FIELDS = ("name", "lr", "grad_clip", "schedule")


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer the plan can name."""

    name: str  # the plan's ``optimizer.name`` (torch.optim's class name, lowercased)
    torch_name: str  # torch.optim's class (what the parity tests compare to); "" if none
    fields: tuple[str, ...]  # the plan fields it reads beside COMMON_FIELDS, torch's names
    defaults: Mapping[str, Any]  # torch's defaults of ``lr`` and those fields, where the plan's
    # own field defaults differ (a field not named here keeps the plan's default)
    states: tuple[tuple[str, str | None], ...]  # (state, the field that turns it on, or None:
    # always kept), per element of the shard, in the order torch's functional form takes them
    counts_steps: bool | str  # reads the count of applied steps (bias corrections, lr decay);
    # a field's name: when that field is set (SGD's dampening: its first step is special)
    max_lr: float  # the largest lr the plan allows (a larger one is a typo)
    lr_why: str  # what lr means for its step, said when lr is too large
    whole_tensors: bool = False  # the update needs each parameter whole (not a flat shard)

    def states_of(self, values: Mapping[str, Any]) -> tuple[str, ...]:
        """The states kept under a plan whose fields hold ``values``."""
        return tuple(name for name, when in self.states if when is None or values.get(when))

    def counts_steps_of(self, values: Mapping[str, Any]) -> bool:
        """Whether it reads the step count under a plan whose fields hold ``values``."""
        if isinstance(self.counts_steps, str):
            return bool(values.get(self.counts_steps))
        return self.counts_steps

    @property
    def all_states(self) -> tuple[str, ...]:
        """Every state it may keep, whatever its fields."""
        return tuple(name for name, _ in self.states)


OPTIMIZERS: dict[str, OptimizerKind] = {}


def register_optimizer(kind: OptimizerKind) -> OptimizerKind:
    """Add ``kind`` to :data:`OPTIMIZERS` (a name is registered once)."""
    if kind.name in OPTIMIZERS:
        raise ValueError(f"optimizer {kind.name!r} is already registered")
    OPTIMIZERS[kind.name] = kind
    return kind


NORMALIZED = "its step moves each weight by about lr, whatever the gradient's scale"
_MOMENTS = (("exp_avg", None), ("exp_avg_sq", None))

register_optimizer(OptimizerKind(
    "adamw", "AdamW", ("betas", "eps", "weight_decay"), {}, _MOMENTS, True, 1.0,
    "an AdamW step moves each weight by about lr",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "adam", "Adam", ("betas", "eps", "weight_decay", "amsgrad"), {},
    (*_MOMENTS, ("max_exp_avg_sq", "amsgrad")), True, 1.0,
    "an Adam step moves each weight by about lr",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "sgd", "SGD", ("momentum", "dampening", "nesterov", "weight_decay"), {},
    (("momentum_buffer", "momentum"),), "dampening", 10.0,
    "an SGD step is lr times the gradient",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "adagrad", "Adagrad",
    ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
    {"lr": 1e-2, "eps": 1e-10}, (("sum", None),), True, 1.0,
    "an Adagrad step moves each weight by about lr",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "rmsprop", "RMSprop", ("alpha", "eps", "weight_decay", "momentum", "centered"),
    {"lr": 1e-2},
    (("square_avg", None), ("momentum_buffer", "momentum"), ("grad_avg", "centered")),
    True, 1.0, "an RMSprop step moves each weight by about lr",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "nadam", "NAdam",
    ("betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay"),
    {"lr": 2e-3}, _MOMENTS, True, 1.0, "an NAdam step moves each weight by about lr",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "radam", "RAdam", ("betas", "eps", "weight_decay", "decoupled_weight_decay"), {},
    _MOMENTS, True, 1.0, "a RAdam step moves each weight by about lr",
))  # fmt: skip
register_optimizer(OptimizerKind(
    "adamax", "Adamax", ("betas", "eps", "weight_decay"), {"lr": 2e-3},
    (("exp_avg", None), ("exp_inf", None)), True, 1.0,
    "an Adamax step moves each weight by about lr",
))  # fmt: skip
# Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): not in torch.optim;
# its update is the paper's (zerocc.backends.kernels.torch_optim.lion).
register_optimizer(OptimizerKind(
    "lion", "", ("betas", "weight_decay"), {"lr": 1e-4, "betas": (0.9, 0.99)},
    (("exp_avg", None),), False, 1.0,
    "a Lion step moves each weight by exactly lr (the sign of its update)",
))  # fmt: skip

# Muon (torch.optim.Muon, torch >= 2.9): each 2-D hidden matrix's update orthogonalized whole,
# once, by the rank that owns it (zerocc.compiler.passes.support.owned_update); the model's
# other parameters take AdamW (optimizer.groups), whose moments it keeps beside its momentum.
register_optimizer(OptimizerKind(
    "muon", "Muon", MUON_FIELDS, MUON_DEFAULTS,
    (("momentum_buffer", None), *_MOMENTS), True, 1.0,
    "a Muon step moves each matrix by about lr (its update is orthogonalized)",
    whole_tensors=True,
))  # fmt: skip

# Every field some optimizer reads beside the common ones (the plan's optimizer section has one
# field for each).
HYPER_FIELDS = tuple(dict.fromkeys(f for k in OPTIMIZERS.values() for f in k.fields))


def kind_of(name: str) -> OptimizerKind:
    """The registered optimizer ``name``."""
    return OPTIMIZERS[name]


def stray_fields(name: str, given: set[str]) -> list[str]:
    """Of the fields ``given`` for optimizer ``name``, those it does not read, sorted."""
    return sorted(given - {*COMMON_FIELDS, *OPTIMIZERS[name].fields})


def readers_of(field_name: str) -> list[str]:
    """The optimizers that read ``field_name``."""
    return [k.name for k in OPTIMIZERS.values() if field_name in k.fields]


# The fields that hold a pair of numbers (the others hold one number or a boolean).
PAIR_FIELDS = ("betas",)


def flat_hyper(kind: OptimizerKind, values: Mapping[str, Any]) -> list[float]:
    """The values of ``kind``'s fields as the update op carries them: floats in the registry's
    order, a pair as two, a boolean as 0 or 1."""
    out: list[float] = []
    for name in kind.fields:
        value = values[name]
        out.extend(float(v) for v in value) if name in PAIR_FIELDS else out.append(float(value))
    return out


def hyper_of(kind: OptimizerKind, flat: list[float]) -> dict[str, Any]:
    """The values :func:`flat_hyper` flattened, by field (a pair as a tuple)."""
    out: dict[str, Any] = {}
    at = 0
    for name in kind.fields:
        width = 2 if name in PAIR_FIELDS else 1
        out[name] = tuple(flat[at : at + 2]) if width == 2 else flat[at]
        at += width
    if at != len(flat):
        raise ValueError(f"{kind.name} reads {at} numbers, the update carries {len(flat)}")
    return out
