"""StateStore: the persistent state a rank keeps between steps, and the ways it is read.

One rank's params, grads and optimizer states as the compile session laid them out (the shards
and flats of its units, the model's buffers, the step's scalars), in memory where the plan
places them or in the files of its NVMe store, allocated once from the model's initial values or
its weight files. Programs bind its tensors; checkpoints save and load them; the whole model is
gathered from them (a collective where they are sharded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.materialize import is_meta, release_to_meta
from zerocc.compiler.state import LOCATIONS, NVME, StateSpec, allocate_state
from zerocc.cost.memory import STATE_CATEGORY
from zerocc.engine.comm import Comm
from zerocc.engine.host_memory import state_tensor
from zerocc.errors import RankMismatchError
from zerocc.ir.nodes import GRAD
from zerocc.ir.ops import TP_GROUP
from zerocc.runtime.nvme import NvmeStore


class StateStore(Mapping[str, torch.Tensor]):
    """The persistent tensors of one rank, by state key: a mapping of those held in memory
    (``store[key]``; what programs bind), with those placed on NVMe in ``nvme``'s files
    (``nvme_specs``). Made by :meth:`allocate`."""

    def __init__(
        self,
        session: CompileSession,
        comm: Comm,
        tensors: dict[str, torch.Tensor],
        nvme: NvmeStore | None,
        state_dict_keys: list[str],
    ) -> None:
        self.session, self.comm = session, comm
        self.tensors = tensors
        self.nvme = nvme
        self.nvme_specs: list[StateSpec] = session.layout.at(NVME)
        self.state_dict_keys = state_dict_keys  # the model's own, in its order

    @classmethod
    def allocate(
        cls,
        model: nn.Module,
        session: CompileSession,
        comm: Comm,
        device: torch.device,
        nvme: NvmeStore | None,
        broadcast: Callable[[torch.Tensor], None] | None = None,
    ) -> StateStore:
        """Allocate every state of ``session``'s layout for this rank, from ``model``'s
        initial values (or its weight files), built one unit at a time so that a meta-device
        model never has more than one unit materialized; rank 0's weights are broadcast where
        the model holds real ones (``broadcast``: from another rank, over another group: a
        pipeline stage's first rank, to its stage's ranks). Afterwards the store owns the
        weights and the model's own copy is released to ``meta``."""
        keys = list(model.state_dict(keep_vars=True))
        mesh = session.mesh
        split = partial(my_slices, session, comm.rank) if session.splits else None
        tensors = allocate_state(
            model,
            session.model_info,
            session.units,
            session.layout,
            session.plan.seed,
            lambda unit: mesh.group_rank(unit.group, comm.rank),
            device,
            partial(state_tensor, device=device),
            nvme,
            from_rank_0=broadcast or (comm.broadcast if comm.world_size > 1 else None),
            split=split,
        )
        if not is_meta(model):
            release_to_meta(model)
        return cls(session, comm, tensors, nvme, keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    # -- single states ----------------------------------------------------------------------

    def read(self, key: str) -> torch.Tensor:
        """A state tensor: the one held in memory, or one read back from the NVMe store."""
        if key in self.tensors:
            return self.tensors[key]
        spec = self.session.layout[key]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        self.nvme.read(key, out).wait()
        return out

    def write(self, key: str, values: torch.Tensor) -> None:
        """Set a state to ``values``: copied into the tensor held in memory, or written to its
        NVMe file."""
        if key in self.tensors:
            if values is not self.tensors[key]:
                self.tensors[key].copy_(values)
        else:
            self.nvme.write(key, values.detach().to("cpu").contiguous()).wait()

    def zero_gradients(self) -> None:
        """Zero the gradient accumulators (a failed micro-batch drops its step's window)."""
        for spec in self.session.layout:
            if spec.role == GRAD and spec.key in self.tensors:
                self.tensors[spec.key].zero_()

    def resident_and_nvme(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor: those held in memory, and those on NVMe read back."""
        return {**self.tensors, **{spec.key: self.read(spec.key) for spec in self.nvme_specs}}

    def bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes of this rank's persistent params, grads and optimizer states (measured) in
        each place they live: ``device``, ``host`` (offload to cpu: on a CPU-only machine, the
        pool apart from the compute's) and ``nvme`` (the files of the rank's store)."""
        layout = self.session.layout
        out = {where: dict.fromkeys(("params", "grads", "optimizer"), 0) for where in LOCATIONS}
        seen: set[int] = set()
        for key, tensor in self.tensors.items():
            spec = layout.get(key)
            storage = tensor.untyped_storage()
            if spec is None or storage.data_ptr() in seen:
                continue  # a view of another state tensor (stage 1-2 shards) is no extra memory
            seen.add(storage.data_ptr())
            out[spec.location][STATE_CATEGORY[spec.role]] += storage.nbytes()
        for spec in self.nvme_specs:
            if self.nvme is not None:
                out[NVME][STATE_CATEGORY[spec.role]] += self.nvme.path_of(spec.key).stat().st_size
        for pool in out.values():
            pool["total"] = sum(pool.values())
        return out

    # -- the whole model --------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full tensor on CPU}`` for every key of the model's ``state_dict()``, in its
        dtypes: the master weights under mixed precision. A collective when the weights are
        sharded (an all-gather on ``dp``; on ``tp`` too for the layers tensor parallelism
        splits): every rank calls it together."""
        full: dict[str, torch.Tensor] = {}
        state = self.resident_and_nvme()
        for unit in self.session.units:
            flat = state.get(f"{unit.key}.master", state[f"{unit.key}.param"])
            if flat.numel() != unit.padded_numel:
                gathered = flat.new_empty(unit.padded_numel)
                self.comm.on(unit.group).all_gather(gathered, flat).wait()
                flat = gathered
            for p in unit.params:
                value = self._joined(p.fqn, unit.unflatten(flat)[p.fqn])
                value = value.detach().to("cpu", p.param.dtype, copy=True)
                full.update(dict.fromkeys(p.param.aliases, value))
        for b in self.session.model_info.buffers:
            if b.fqn in self.tensors:
                full.update(dict.fromkeys(b.aliases, self.tensors[b.fqn].detach().cpu().clone()))
        return {k: full[k] for k in self.state_dict_keys if k in full}

    def _joined(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """The full value of a parameter of which this rank holds ``value``: gathered from
        the ranks that split it (a collective on their group: ``tp`` for tensor parallelism's
        layers, ``ep`` for the experts)."""
        split = self.session.splits.get(fqn)
        if split is None:
            return value
        parts = value.new_empty((split.parts, *value.shape))
        group = self.comm.on(split.group)
        group.all_gather(parts.view(-1), value.contiguous().view(-1)).wait()
        return split.join(list(parts))

    def materialize_model(
        self,
        model: nn.Module,
        device: str | torch.device,
        full: dict[str, torch.Tensor] | None = None,
    ) -> nn.Module:
        """``model`` (on ``meta`` once the store owns its weights) given the current weights
        and buffers, on ``device``; a collective where they are sharded (see
        :meth:`full_state_dict`). ``full``: the whole model's state dict when this store holds
        a part of it (a pipeline rank's stages), gathered by the caller."""
        full = self.full_state_dict() if full is None else full
        buffers = {
            b.fqn: self.tensors[b.fqn]
            for b in self.session.model_info.buffers
            if b.fqn in self.tensors
        }
        model.to_empty(device=device)
        model.load_state_dict(full)
        held = dict(model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for fqn, value in buffers.items():  # non-persistent ones too (not in state_dict)
                held[fqn].copy_(value)
        return model

    # -- this rank's shards -----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors, keyed with its rank (``rank1/transformer.h.0.param``): every
        persistent one but the views of others (stage 1-2 shards)."""
        prefix = f"rank{self.comm.rank}/"
        return {
            prefix + k: t
            for k, t in self.resident_and_nvme().items()
            if not k.endswith(".param_shard")
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore this rank's tensors from what :meth:`state_dict` gave (RankMismatchError
        naming the first missing when ``sd`` lacks some)."""
        prefix = f"rank{self.comm.rank}/"
        nvme = {s.key for s in self.nvme_specs}
        expected = {k for k in [*self.tensors, *nvme] if not k.endswith(".param_shard")}
        missing = sorted(expected - {k.removeprefix(prefix) for k in sd if k.startswith(prefix)})
        if missing:
            raise RankMismatchError(f"checkpoint lacks {missing[:3]} for rank {self.comm.rank}")
        for key in sorted(expected - nvme) + sorted(nvme):
            self.write(key, sd[prefix + key])


def my_slices(
    session: CompileSession, rank: int, values: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``rank``'s slices of full parameter values (tensor and expert parallelism)."""
    splits, mesh = session.splits, session.mesh
    return {
        fqn: splits[fqn].take(v, mesh.group_rank(splits[fqn].group, rank))
        if fqn in splits
        else v
        for fqn, v in values.items()
    }


def align_random_state(comm: Comm, session: CompileSession, device: torch.device) -> None:
    """Give the ranks of this rank's tp group its first rank's random number generators
    (a collective on ``tp``). They run one program on tensors of one shape, so they stay in
    step from here: dropout where they all hold the whole tensor draws one mask, as it must
    (ranks seeded by their rank would otherwise drift apart without an error)."""
    group = comm.on(TP_GROUP)
    first = comm.rank - session.mesh.tp_rank(comm.rank)  # (its global rank)
    state = torch.get_rng_state().to(device)
    group.broadcast(state, first)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device).to(device)
        group.broadcast(state, first)
        torch.cuda.set_rng_state(state.cpu(), device)
