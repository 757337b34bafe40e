"""FSDP units and their flat layout: which parameters, where in the flat buffer, padded how."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerocc.compiler.capture import ParamInfo
from zerocc.ir.ops import DP_GROUP

ROOT = "root"  # the name of the model's own unit (its parameters outside every unit root)
FROZEN = "[frozen]"  # the suffix of a unit of frozen parameters


@dataclass(frozen=True)
class UnitParam:
    """A parameter's place in its unit's flat buffer."""

    param: ParamInfo
    offset: int

    @property
    def fqn(self) -> str:
        return self.param.fqn

    @property
    def numel(self) -> int:
        return self.param.numel


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: parameters flattened into one buffer padded to a multiple of the world size.

    ``trainable`` units get gradients and optimizer state; frozen ones (``requires_grad=False``)
    are only gathered for use. ``group``: the mesh's group of ``world_size`` ranks it is
    sharded, gathered and reduced over (``dp``; an experts unit's: ``edp``). ``modules``: the
    unit roots (module FQNs, "" for the model) whose parameters it holds, where it holds
    several (``units.blocks_per_unit``: ``transformer.h.0-1`` holds ``transformer.h.0`` and
    ``transformer.h.1``); empty for a unit of one module, its name.
    """

    name: str
    params: tuple[UnitParam, ...]
    trainable: bool
    world_size: int
    dtype: torch.dtype
    group: str = DP_GROUP
    modules: tuple[str, ...] = ()

    @staticmethod
    def build(
        name: str,
        params: list[ParamInfo],
        world_size: int,
        group: str = DP_GROUP,
        modules: tuple[str, ...] = (),
    ) -> Unit:
        placed, offset = [], 0
        for p in params:
            placed.append(UnitParam(p, offset))
            offset += p.numel
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"unit {name!r} mixes dtypes {sorted(map(str, dtypes))}")
        trainable, dtype = params[0].requires_grad, params[0].dtype
        return Unit(name, tuple(placed), trainable, world_size, dtype, group, modules)

    @property
    def roots(self) -> tuple[str, ...]:
        """The module FQNs whose parameters the unit holds ("" for the model's root)."""
        if self.modules:
            return self.modules
        name = self.key.removesuffix(FROZEN)
        return ("" if name == ROOT else name,)

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters, without padding."""
        return sum(p.numel for p in self.params)

    @property
    def padded_numel(self) -> int:
        """Elements of the flat buffer: ``numel`` rounded up to a multiple of the world size."""
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard."""
        return self.padded_numel // self.world_size

    @property
    def key(self) -> str:
        """Prefix of the unit's state keys (``<key>.param``, ``<key>.grad``, ...)."""
        return self.name or ROOT

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The padded flat buffer of the given full parameter values (by FQN)."""
        like = tensors[self.params[0].fqn]
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=like.device)
        for p in self.params:
            flat[p.offset : p.offset + p.numel].copy_(tensors[p.fqn].reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of each parameter in a full flat buffer."""
        return {p.fqn: flat[p.offset : p.offset + p.numel].view(p.param.shape) for p in self.params}

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of a full flat buffer (a view)."""
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]


@dataclass(frozen=True)
class ExpertUnits:
    """The experts modules (by FQN) whose parameters expert parallelism splits, each a unit
    sharded over ``world_size`` ranks (the mesh's ``edp`` group)."""

    modules: frozenset[str]
    world_size: int
