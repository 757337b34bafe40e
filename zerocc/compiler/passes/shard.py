"""shard: flat parameters per unit, and the communication of ZeRO stages 0-3.

Parameters become one flat buffer per unit, padded to a multiple of the world size. Per stage:

- 3: each rank holds a shard. A unit is all-gathered before its first use in forward and freed
  after its last, gathered again before its first use in backward and freed after its last;
  its gradient is reduce-scattered right after its last contribution and added to the rank's
  gradient shard. A unit the plan keeps gathered (``units.keep_gathered``) is gathered once,
  before its first use, and freed after its last use in the step. With a secondary partition
  (``zero.secondary_group: G``, ZeRO++'s hpZ), before forward frees a unit each rank copies
  its 1/G of it (by its place in its ``secondary`` group), and backward gathers the unit over
  that group of G ranks from those copies, not over the shard group from the shards: the same
  values forward computed with (quantized ones too), with no traffic beyond the G ranks.
- 2: parameters replicated; gradients reduce-scattered as they are produced, each rank keeping
  only its gradient shard.
- 1: parameters and full gradients replicated; gradients accumulate over micro-batches and are
  reduce-scattered once, at the end of backward of the micro-batch that steps.
- 0: DDP: full gradients accumulate, all-reduced as each unit's gradient completes on the
  micro-batch that steps.

Without accumulation (``grad_accumulation: 1``) no gradient is kept between steps: each unit's
gradients are packed into one buffer as soon as they are complete and reduced (all-reduced at
stage 0, reduce-scattered at stages 1-3), and the update reads the collective's result. Stage 1
then reduces as stage 2 does.

A world of one rank communicates nothing: parameters are read where they are kept (stage 3's
shard is the whole flat), nothing is gathered, packed or reduced, and without accumulation the
update reads each parameter's gradient where backward left it (a unit whose states are
offloaded packs its gradient for the copy to the host).

The reduced gradient each unit's optimizer update reads is tagged ``grad_shard`` (world size 1
without accumulation: one per parameter, with its ``span`` in the flat buffer); the optimizer
pass acts on those tags. Collectives are start/wait pairs, the wait right after its start (the
overlap pass moves them). Collectives sum; the 1/(ranks × micro-batches) mean is applied by the
update.
"""

from __future__ import annotations

import torch
from torch import fx

from zerocc.compat import LazyGraphModule
from zerocc.compiler.names import glob_matches
from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.passes.support.gradients import (
    Gradients,
    flat_view,
    quantized_bytes,
    solo,
    unit_collective,
)
from zerocc.compiler.passes.support.param_uses import ParamUses, analyze
from zerocc.compiler.plan import OffloadConfig, ZeroConfig
from zerocc.compiler.state import DEVICE, declare_params, placements
from zerocc.compiler.units import Unit
from zerocc.errors import InvariantError, PlanError
from zerocc.ir.fake_values import example_value
from zerocc.ir.nodes import (
    GATHERED,
    PARAM,
    copy_node,
    emit,
    info,
    state_placeholder,
    tag,
)
from zerocc.ir.ops import DP_GROUP, SECONDARY_GROUP, op
from zerocc.ir.wire import QUANT_BLOCK

aten = torch.ops.aten


class _ShardRewriter:
    """Copies the captured graph into a new one, inserting the stage's flat params and comm."""

    def __init__(
        self,
        gm: fx.GraphModule,
        ctx: PassContext,
        zero: ZeroConfig,
        kept: set[str],
        grad_accumulation: int,
        offload: OffloadConfig,
    ) -> None:
        self.old, self.ctx, self.zero, self.kept = gm, ctx, zero, kept
        self.grad_accumulation = grad_accumulation
        where = placements(ctx.units, offload)
        self.offloaded = {name for name, place in where.items() if place.offloaded}
        # Parameter values are re-derived per phase where each phase reads its own copy: stage
        # 3's gathers, or at world size 1 the device copies offload makes of shards it keeps off
        # the device (so that forward's copy is not kept alive into backward).
        self.per_phase = zero.shards_params and (
            any(self.gathers(u) for u in ctx.units)
            or any(place.params != DEVICE for place in where.values())
        )
        self.units = {u.name: u for u in ctx.units}
        self.uses: ParamUses = analyze(gm, [p.fqn for p in ctx.model.trainable])
        self.param_of = {n: info(n).key for n in self.uses.unit_of}
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.flat: dict[tuple[str, str], fx.Node] = {}  # (unit, scope) -> gathered flat param
        self.memo: dict[tuple[fx.Node, str], fx.Node] = {}
        self.state: dict[str, dict[str, fx.Node]] = {}  # unit -> {"param", "param_shard", "grad"}
        self.secondary: dict[str, fx.Node] = {}  # unit -> its copy kept for backward (hpZ)

    def gathers(self, unit: Unit) -> bool:
        """Whether the unit's parameters are gathered for use: stage 3, sharded over more than
        one rank (a unit of one rank, on one rank or in a one-rank `edp` group, is read where
        it is kept: nothing to gather, pack or reduce)."""
        return self.zero.shards_params and not solo(unit)

    # -- placeholders -----------------------------------------------------------------------

    def add_placeholders(self) -> None:
        like = example_value(self.old.graph)
        for unit in self.ctx.units:  # as the pass declared them (`declare_params`)
            self.state[unit.name] = {
                name: state_placeholder(self.graph, spec, like)
                for name, spec in self.ctx.layout.of_unit(unit).items()
            }
        for n in self.old.graph.nodes:
            if n.op == "placeholder" and info(n).role != PARAM:
                self.env[n] = copy_node(self.graph, n, lambda a: a)

    # -- parameter values -------------------------------------------------------------------

    def scope(self, phase: str, unit: str | None = None) -> str:
        """Which copy of the parameters a use in ``phase`` reads: per phase in stage 3 (one for
        the whole step for a kept unit), the resident parameters otherwise."""
        if not self.per_phase:
            return "resident"
        return "step" if unit in self.kept else phase

    def value(self, node: fx.Node, phase: str) -> fx.Node:
        """The new graph's value for an old node, re-deriving parameter values in scope."""
        if node not in self.uses.roots:
            return self.env[node]
        key = (node, self.scope(phase))
        if key not in self.memo:
            if node in self.uses.unit_of:
                self.memo[key] = self.param_view(node, phase)
            else:
                new = copy_node(self.graph, node, lambda a: self.value(a, phase))
                self.memo[key] = tag(new, phase=phase)
        return self.memo[key]

    def param_view(self, node: fx.Node, phase: str) -> fx.Node:
        unit = self.units[self.uses.unit_of[node]]
        if self.gathers(unit):
            flat = self.flat[(unit.name, self.scope(phase, unit.name))]
        else:  # read where it is kept: the replicated flat, or (one rank) the whole shard
            flat = self.state[unit.name]["param"]
        return flat_view(self.graph, flat, unit, self.param_of[node], phase)

    # -- communication ----------------------------------------------------------------------

    def gather(self, unit: Unit, phase: str) -> None:
        scope = self.scope(phase, unit.name)
        if (unit.name, scope) in self.flat:  # kept gathered since forward
            return
        if unit.name in self.secondary and phase == "backward":
            self.flat[(unit.name, scope)] = self.gather_secondary(unit)
            return
        when = "step" if scope == "step" else phase
        shard = self.state[unit.name]["param"]
        if (wire := self.zero.quantized_weights) != "none":
            start = "all_gather_quantized_start"
            args = (shard, unit.world_size, QUANT_BLOCK, wire)
            nbytes, how = quantized_bytes(unit, wire), f" in {wire}"
        else:
            start, args = "all_gather_start", (shard, unit.world_size)
            nbytes, how = unit.padded_numel * unit.dtype.itemsize, ""
        flat = unit_collective(
            self.graph,
            start,
            (*args, unit.group),
            unit,
            phase,
            nbytes,
            f"gather {unit.name}{how} before its first use in {when}",
            role=GATHERED,
        )
        self.flat[(unit.name, scope)] = flat

    def keeps_secondary(self, unit: Unit, phase: str) -> bool:
        """Whether forward, ending with ``unit``, keeps a copy of its part for backward (a
        secondary partition: a unit of the shard group, gathered again in backward)."""
        return (
            self.zero.secondary_group > 1
            and phase == "forward"
            and unit.group == DP_GROUP
            and self.scope(phase, unit.name) == "forward"
            and (unit.name, "backward") in self.uses.windows
        )

    def keep_secondary(self, unit: Unit, flat: fx.Node) -> None:
        """This rank's 1/G of forward's gathered ``flat``, copied (by its place in its
        ``secondary`` group) for backward's gather."""
        g = self.zero.secondary_group
        where = {"phase": "forward", "unit": unit.name}
        place = emit(self.graph, op("group_rank"), (flat, SECONDARY_GROUP), **where)
        index = emit(self.graph, aten.view.default, (place, [1]), **where)
        rows = emit(self.graph, aten.view.default, (flat, [g, unit.padded_numel // g]), **where)
        part = emit(
            self.graph,
            aten.index_select.default,
            (rows, 0, index),
            role=GATHERED,
            note=f"keep this rank's 1/{g} of {unit.name} for backward's gather over its "
            "secondary group (hpZ)",
            **where,
        )
        self.secondary[unit.name] = emit(
            self.graph, aten.view.default, (part, [unit.padded_numel // g]), **where
        )

    def gather_secondary(self, unit: Unit) -> fx.Node:
        """Backward's gather of ``unit`` over its secondary group, from the parts forward kept."""
        g = self.zero.secondary_group
        return unit_collective(
            self.graph,
            "all_gather_start",
            (self.secondary.pop(unit.name), g, SECONDARY_GROUP),
            unit,
            "backward",
            unit.padded_numel * unit.dtype.itemsize,
            f"gather {unit.name} over its secondary group of {g} (hpZ) before its first use "
            "in backward",
            role=GATHERED,
        )

    def free(self, unit: Unit, phase: str) -> None:
        scope = self.scope(phase, unit.name)
        if scope == "step" and phase == "forward" and (unit.name, "backward") in self.uses.windows:
            return  # kept gathered for its use in backward
        if self.keeps_secondary(unit, phase):
            self.keep_secondary(unit, self.flat[(unit.name, scope)])
        flat = self.flat.pop((unit.name, scope))
        when = "step" if scope == "step" else phase
        emit(
            self.graph,
            op("free"),
            (flat,),
            phase=phase,
            unit=unit.name,
            note=f"free {unit.name} after its last use in {when}",
        )

    # -- the rewrite ------------------------------------------------------------------------

    def last_contribution(self) -> dict[fx.Node, list[Unit]]:
        """For each trainable unit the loss reaches, the node after which its gradient is complete.

        A unit none of whose parameters reaches the loss has no gradient: like torch.optim with
        ``grad=None``, it is neither reduced nor updated.
        """
        order = self.uses.order
        at: dict[fx.Node, list[Unit]] = {}
        for unit in self.ctx.units:
            producers = [self.uses.grads.get(p.fqn) for p in unit.params] if unit.trainable else []
            producers = [g for g in producers if g is not None]  # none: an evaluation program
            if producers:
                at.setdefault(max(producers, key=order.__getitem__), []).append(unit)
        return at

    def accumulated_units(self) -> set[str]:
        """A pipeline rank's update: the trainable units with a gradient accumulated."""
        if self.grad_accumulation == 1:
            raise InvariantError("a pipeline rank's update reads accumulated gradients")
        update_of = self.ctx.update_of or frozenset()
        return {
            u.name
            for u in self.ctx.units
            if u.trainable and any(p.fqn in update_of for p in u.params)
        }

    def run(self) -> fx.Graph:
        self.add_placeholders()
        complete = self.last_contribution()
        accumulators = {u: nodes["grad"] for u, nodes in self.state.items() if "grad" in nodes}
        gradients = Gradients(
            self.graph,
            self.ctx,
            self.zero,
            self.grad_accumulation,
            self.uses,
            self.env,
            accumulators,
            self.offloaded,
        )
        output = None
        for node in self.old.graph.nodes:
            if node.op == "placeholder" or node in self.uses.derived:
                continue
            if node.op == "output":
                output = node
                continue
            phase = info(node).phase
            for unit_name in self.uses.starting_at(node):
                if self.gathers(self.units[unit_name]):
                    self.gather(self.units[unit_name], phase)
            self.env[node] = copy_node(self.graph, node, lambda a, ph=phase: self.value(a, ph))
            gradients.produced(node)
            for unit in complete.get(node, []):
                gradients.complete(unit)
            for unit_name in self.uses.ending_at(node):
                if self.gathers(self.units[unit_name]):
                    self.free(self.units[unit_name], phase)
        reached = {u.name for units in complete.values() for u in units}
        if self.ctx.update_of is not None:  # a pipeline rank's update: accumulated already
            reached = self.accumulated_units()
            for unit in self.ctx.units:
                if unit.name in reached:
                    gradients.accumulated(unit)
        gradients.after_backward([u for u in self.ctx.units if u.name in reached])
        loss = output.args[0][0]  # None in a pipeline stage's program that computes no loss
        self.graph.output(None if loss is None else self.env[loss])
        return self.graph


def kept_gathered(
    units: list[Unit], patterns: list[str], below_mb: float | None, itemsize: int
) -> set[str]:
    """Names of the units kept gathered for the whole step: those whose name (``root`` for the
    root unit) matches a pattern, and those smaller than ``below_mb`` when gathered."""
    kept = set()
    for pattern in patterns:
        hits = {u.name for u in units if glob_matches(u.key, pattern)}
        if not hits:
            names = ", ".join(u.key for u in units[:6])
            raise PlanError(
                f"units.keep_gathered: pattern {pattern!r} matches no unit; units are: {names}"
            )
        kept |= hits
    if below_mb is not None:
        kept |= {u.name for u in units if u.padded_numel * itemsize < below_mb * 2**20}
    return kept


def _options(plan) -> dict:
    return {
        "zero": plan.zero,
        "keep_gathered": plan.units.keep_gathered,
        "keep_gathered_below_mb": plan.units.keep_gathered_below_mb,
        "itemsize": plan.precision.dtype("param").itemsize,
        "grad_accumulation": plan.grad_accumulation,
        "offload": plan.offload,
    }


@register_pass(
    "shard",
    requires=("units",),
    provides=("sharded_params", "grad_shards"),
    options=_options,
    declares=lambda layout, units, plan: declare_params(layout, units, plan, precision=None),
)
def shard(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    zero: ZeroConfig,
    keep_gathered: list[str] = (),
    keep_gathered_below_mb: float | None = None,
    itemsize: int = 4,
    grad_accumulation: int = 1,
    offload: OffloadConfig | None = None,
) -> fx.GraphModule:
    """Flatten each unit's parameters and insert the gathers, frees and reductions that
    ``zero``'s stage asks for (none on one rank)."""
    kept = kept_gathered(ctx.units, list(keep_gathered), keep_gathered_below_mb, itemsize)
    gathering = zero.shards_params and not all(solo(u) for u in ctx.units)
    rewriter = _ShardRewriter(
        gm,
        ctx,
        zero,
        kept if gathering else set(),
        grad_accumulation,
        offload or OffloadConfig(),
    )
    return LazyGraphModule(gm, rewriter.run())
