"""Where the shard pass sends each unit's gradient: accumulators, packs and reductions.

A unit's gradient of one micro-batch is complete after its last contribution in backward. What
follows depends on the stage, on ``grad_accumulation`` and on the world size:

- **With accumulation** (``grad_accumulation`` > 1) gradients persist between micro-batches in
  the unit's ``grad`` state. Stages 0-1 add each parameter's gradient into its view of the full
  accumulator and reduce it on the micro-batch that steps (stage 0: an all-reduce per unit as
  it completes; stage 1: a reduce-scatter per unit after backward). Stages 2-3 pack the unit's
  gradients, reduce-scatter them every micro-batch and add the result into the gradient shard.
- **Without accumulation** nothing of a gradient outlives the step: the unit's gradients are
  packed once complete and reduced (all-reduced in place at stage 0, reduce-scattered at stages
  1-3), and the update reads the collective's result.
- **One rank** reduces nothing and packs nothing: with accumulation every stage adds into views
  of the accumulator (the shard is the whole flat); without, the update reads each parameter's
  gradient where backward left it (one ``grad_shard`` per parameter, with its ``span`` in the
  flat). A unit whose optimizer states live off the device gets one packed gradient instead,
  which offload copies to the host in one piece.
- **Hybrid sharding** (``zero.replicate``): the reduced shard an update reads (or, with
  accumulation, the shard accumulator on the stepping micro-batch) is all-reduced in place
  across the ranks holding the same shard (group ``replicate``), and the update reads that.

The gradient each update reads is tagged ``grad_shard`` (the optimizer pass acts on the tags),
with the flat ranges of parameters the loss does not reach (``no_grad``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import fx

from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.passes.support.param_uses import ParamUses
from zerocc.compiler.plan import ZeroConfig
from zerocc.compiler.units import Unit
from zerocc.ir.nodes import GRAD_SHARD, emit, emit_collective, info, tag, val
from zerocc.ir.ops import DP_GROUP, REPLICATE_GROUP, TIE_GROUP, op
from zerocc.ir.wire import QUANT_BLOCK, wire_format

aten = torch.ops.aten


def flat_view(graph: fx.Graph, flat: fx.Node, unit: Unit, fqn: str, phase: str) -> fx.Node:
    """Parameter ``fqn``'s view of one of its unit's flat buffers (weights or gradients)."""
    placed = next(p for p in unit.params if p.fqn == fqn)
    where = {"phase": phase, "unit": unit.name}
    span = (flat, 0, placed.offset, placed.offset + placed.numel)
    sliced = emit(graph, aten.slice.Tensor, span, **where)
    return emit(graph, aten.view.default, (sliced, list(placed.param.shape)), **where)


def quantized_bytes(unit: Unit, wire: str) -> int:
    """Bytes of the unit's flat in a collective quantized to the wire format ``wire``: every
    rank's shard, its values and a 4-byte scale per block."""
    return wire_format(wire).shard_bytes(unit.shard_numel) * unit.world_size


def unit_collective(
    graph: fx.Graph,
    start_op: str,
    args: tuple,
    unit: Unit,
    phase: str,
    nbytes: int,
    note: str,
    role: str | None = None,
) -> fx.Node:
    """A collective of ``unit`` (start and wait; returns the wait)."""
    return emit_collective(
        graph,
        op(start_op),
        op("wait"),
        args,
        nbytes=nbytes,
        note=note,
        role=role,
        phase=phase,
        unit=unit.name,
    )


class GradientContext(Protocol):
    """What the gradient routing reads of the shard pass's context (a ``PassContext``). A
    protocol, not the class: the helpers sit below the passes and import nothing of them."""

    @property
    def mesh(self) -> Mesh: ...
    @property
    def units(self) -> list[Unit]: ...
    @property
    def boundary(self) -> bool: ...
    @property
    def tied(self) -> frozenset[str]: ...
    @property
    def update_of(self) -> frozenset[str] | None: ...


def solo(unit: Unit) -> bool:
    """Whether ``unit`` is held by one rank of its group (on one rank, or in a one-rank `edp`
    group: every expert on its own rank): its gradient is complete where backward leaves it,
    nothing to reduce (hybrid sharding, whose replicas would, never shards over one rank)."""
    return unit.world_size == 1


class Gradients:
    """Emits, into the shard pass's new graph, what happens to each unit's gradient."""

    def __init__(
        self,
        graph: fx.Graph,
        ctx: GradientContext,
        zero: ZeroConfig,
        grad_accumulation: int,
        uses: ParamUses,
        env: dict[fx.Node, fx.Node],
        accumulators: dict[str, fx.Node],
        offloaded: set[str],
    ) -> None:
        self.graph, self.ctx, self.uses, self.env = graph, ctx, uses, env
        self.zero = zero
        self.accumulate = grad_accumulation > 1
        self.replicas = ctx.mesh.replicate  # > 1: shards replicated (HSDP)
        self.accumulators = accumulators  # unit -> its `grad` placeholder (with accumulation)
        self.offloaded = offloaded  # units whose states offload keeps off the device
        self.fqns_of: dict[fx.Node, list[str]] = {}
        for fqn, grad in uses.grads.items():
            if grad is not None:
                self.fqns_of.setdefault(grad, []).append(fqn)
        self.unit_of = {p.fqn: u for u in ctx.units for p in u.params}

    def produced(self, old: fx.Node) -> None:
        """After backward produced ``old`` (in the new graph, ``env[old]``): add the parameter
        gradients it is into their views of the full accumulator, where gradients are
        accumulated per parameter (stages 0-1; every stage on one rank)."""
        if not self.accumulate:
            return
        for fqn in self.fqns_of.get(old, []):
            unit = self.unit_of[fqn]
            if self.zero.shards_gradients and not solo(unit):
                continue  # (reduced into its shard once complete)
            acc = flat_view(self.graph, self.accumulators[unit.name], unit, fqn, "backward")
            emit(self.graph, aten.add_.Tensor, (acc, self.env[old]), **self._at(unit))

    def complete(self, unit: Unit) -> None:
        """The unit's gradient of this micro-batch is complete."""
        if not self.accumulate:
            if solo(unit):
                self.keep_for_update(unit)
            else:
                self.reduce_for_update(unit)
        elif solo(unit):
            if self.ctx.boundary:  # the update reads the accumulator itself
                note = f"{unit.name}'s accumulated gradient, complete"
                grad = (self.accumulators[unit.name],)
                at = self._at(unit)
                emit(self.graph, aten.alias.default, grad, role=GRAD_SHARD, note=note, **at)
        elif self.zero.shards_gradients:
            self.reduce_into_shard(unit)
        elif not self.zero.shards_optimizer and self.ctx.boundary:
            self.reduce_accumulated(unit)

    def accumulated(self, unit: Unit) -> None:
        """A pipeline rank's update: the unit's gradient, accumulated over the micro-batches by
        the stages' backward programs, reduced for the update (stages 0-1; stage 1 in
        :meth:`after_backward`) or read where it is (reduced already, stages 2-3)."""
        if solo(unit) or self.zero.shards_gradients:
            note = f"{unit.name}'s accumulated gradient, complete"
            grad = (self.accumulators[unit.name],)
            reduced = emit(self.graph, aten.alias.default, grad, role=GRAD_SHARD, note=note,
                           **self._at(unit))  # fmt: skip
            if not solo(unit):
                reduced = self.across_replicas(reduced, unit)
        elif not self.zero.shards_optimizer:
            reduced = self.reduce_accumulated(unit)
        else:
            return  # stage 1 on several ranks: reduced after backward
        if unit.name in self.ctx.tied:
            self.across_tied_stages(reduced, unit)

    def across_tied_stages(self, reduced: fx.Node, unit: Unit) -> fx.Node:
        """A tied unit (pipeline): the ``reduced`` gradient, this rank's stages' part, summed
        with the other pipeline rank's that holds the unit; the update reads the sum."""
        numel = unit.shard_numel if self.zero.shards_optimizer else unit.padded_numel
        note = f"all-reduce {unit.name}'s gradient with the other pipeline stage that holds it"
        return self._summed_over(reduced, unit, TIE_GROUP, numel, note)

    def after_backward(self, reached: list[Unit]) -> None:
        """Stage 1 with accumulation reduces each accumulated gradient once, after backward of
        the micro-batch that steps; then every ``grad_shard`` learns its unreached ranges."""
        if self.zero.stage == 1 and self.ctx.boundary and self.accumulate:
            for unit in (u for u in reached if not solo(u)):
                reduced = self.reduce_accumulated(unit)
                if unit.name in self.ctx.tied:
                    self.across_tied_stages(reduced, unit)
        units = {u.name: u for u in self.ctx.units}
        for node in self.graph.nodes:
            if info(node).role == GRAD_SHARD and info(node).span is None:
                tag(node, no_grad=self.unreached_ranges(units[info(node).unit]))

    # -- what each case emits ---------------------------------------------------------------

    def pack(self, unit: Unit, note: str, role: str | None = None) -> fx.Node:
        """The unit's gradients in one flat buffer (zeros for a parameter without one)."""
        grads = [
            None if self.uses.grads[p.fqn] is None else self.env[self.uses.grads[p.fqn]]
            for p in unit.params
        ]
        args = (grads, [p.numel for p in unit.params], unit.padded_numel)
        return emit(self.graph, op("pack"), args, note=note, role=role, **self._at(unit))

    def reduce_scatter(self, full: fx.Node, unit: Unit, note: str, role: str | None) -> fx.Node:
        if (wire := self.zero.quantized_grads) != "none":
            start = "reduce_scatter_quantized_start"
            args = (full, unit.world_size, QUANT_BLOCK, wire)
            nbytes, note = quantized_bytes(unit, wire), f"{note}, in {wire}"
        else:
            start, args = "reduce_scatter_start", (full, unit.world_size)
            nbytes = unit.padded_numel * unit.dtype.itemsize
        return unit_collective(
            self.graph, start, (*args, unit.group), unit, "backward", nbytes, note, role
        )

    def all_reduce(self, full: fx.Node, unit: Unit) -> fx.Node:
        nbytes = 2 * unit.padded_numel * unit.dtype.itemsize
        note = f"all-reduce {unit.name}'s gradient (DDP)"
        return unit_collective(
            self.graph, "all_reduce_start", (full, unit.group), unit, "backward", nbytes, note,
            GRAD_SHARD,
        )  # fmt: skip

    def across_replicas(self, shard: fx.Node, unit: Unit) -> fx.Node:
        """Hybrid sharding: the reduced gradient ``shard`` all-reduced across the ranks that
        hold the same shard (what the update reads; ``shard`` itself without replicas, and
        for an experts' unit, whose ``edp`` group holds every rank with its experts)."""
        if self.replicas == 1 or unit.group != DP_GROUP:
            return shard
        note = f"all-reduce {unit.name}'s gradient shard across its {self.replicas} replicas"
        return self._summed_over(shard, unit, REPLICATE_GROUP, unit.shard_numel, note)

    def _summed_over(
        self, reduced: fx.Node, unit: Unit, group: str, numel: int, note: str
    ) -> fx.Node:
        """The gradient the update was to read, ``reduced``, all-reduced in place over
        ``group``: the update reads the all-reduce's result instead."""
        tag(reduced, role=None)
        nbytes = 2 * numel * unit.dtype.itemsize
        return unit_collective(
            self.graph, "all_reduce_start", (reduced, group), unit, "backward", nbytes, note,
            GRAD_SHARD,
        )  # fmt: skip

    def reduce_into_shard(self, unit: Unit) -> None:
        """Stages 2-3 with accumulation: pack, reduce-scatter, add into the gradient shard."""
        packed = self.pack(unit, f"{unit.name}'s gradients, for their reduce-scatter")
        note = f"reduce-scatter {unit.name}'s gradient after its last contribution"
        reduced = self.reduce_scatter(packed, unit, note, None)
        role = GRAD_SHARD if self.ctx.boundary else None
        args = (self.accumulators[unit.name], reduced)
        added = emit(self.graph, aten.add_.Tensor, args, role=role, **self._at(unit))
        if self.ctx.boundary:
            self.across_replicas(added, unit)

    def reduce_accumulated(self, unit: Unit) -> fx.Node:
        """Stages 0-1 with accumulation, stepping micro-batch: reduce the full accumulator;
        returns what the update reads."""
        grad = self.accumulators[unit.name]
        if not self.zero.shards_optimizer:
            return self.all_reduce(grad, unit)
        note = f"reduce-scatter {unit.name}'s accumulated gradient"
        return self.across_replicas(self.reduce_scatter(grad, unit, note, GRAD_SHARD), unit)

    def reduce_for_update(self, unit: Unit) -> None:
        """Without accumulation: pack once complete, reduce for the update (all-reduce in place
        at stage 0, reduce-scatter at stages 1-3)."""
        packed = self.pack(unit, f"{unit.name}'s gradients, for their reduction")
        if not self.zero.shards_optimizer:
            self.all_reduce(packed, unit)
        else:
            note = f"reduce-scatter {unit.name}'s gradient after its last contribution"
            self.across_replicas(self.reduce_scatter(packed, unit, note, GRAD_SHARD), unit)

    def keep_for_update(self, unit: Unit) -> None:
        """One rank without accumulation: each parameter's gradient where backward left it,
        flattened (a view; a copy only of a non-contiguous one); one pack for a unit whose
        optimizer states offload keeps off the device (its copy to the host is one piece)."""
        if unit.name in self.offloaded:
            self.pack(unit, f"{unit.name}'s gradients, for the copy to the host", GRAD_SHARD)
            return
        for p in unit.params:
            if self.uses.grads[p.fqn] is None:
                continue  # not reached by the loss: no update, as torch.optim skips grad=None
            grad = self.env[self.uses.grads[p.fqn]]
            if not val(grad).is_contiguous():
                grad = emit(self.graph, aten.clone.default, (grad,), **self._at(unit))
                grad.kwargs = {"memory_format": torch.contiguous_format}
            note = f"the gradient of {p.fqn}, read by its update where backward left it"
            emit(
                self.graph, aten.view.default, (grad, [-1]), role=GRAD_SHARD,
                span=(p.offset, p.numel), note=note, **self._at(unit),
            )  # fmt: skip

    def unreached_ranges(self, unit: Unit) -> tuple[int, ...]:
        """(offset, numel) pairs of the unit's parameters the loss does not reach."""
        update_of = self.ctx.update_of
        if update_of is not None:
            pairs = [(p.offset, p.numel) for p in unit.params if p.fqn not in update_of]
        else:
            pairs = [(p.offset, p.numel) for p in unit.params if self.uses.grads[p.fqn] is None]
        return tuple(x for pair in pairs for x in pair)

    @staticmethod
    def _at(unit: Unit) -> dict[str, str]:
        return {"phase": "backward", "unit": unit.name}
