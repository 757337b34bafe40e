"""shard: flat parameters per unit, and the communication of ZeRO stages 0-3.

Parameters become one flat buffer per unit, padded to a multiple of the world size. Per stage:

- 3: each rank holds a shard. A unit is all-gathered before its first use in forward and freed
  after its last, gathered again before its first use in backward and freed after its last;
  its gradient is reduce-scattered right after its last contribution and added to the rank's
  gradient shard. A unit the plan keeps gathered (``units.keep_gathered``) is gathered once,
  before its first use, and freed after its last use in the step.
- 2: parameters replicated; gradients reduce-scattered as they are produced, each rank keeping
  only its gradient shard.
- 1: parameters and full gradients replicated; gradients accumulate over micro-batches and are
  reduce-scattered once, at the end of backward of the micro-batch that steps.
- 0: DDP: full gradients accumulate, all-reduced as each unit's gradient completes on the
  micro-batch that steps.

The reduced gradient each unit's optimizer update reads is tagged ``grad_shard``; the optimizer
pass acts on those tags. Collectives are start/wait pairs, the wait right after its start (the
overlap pass moves them). Collectives sum; the 1/(ranks × micro-batches) mean is applied by the
update.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import fx
from zerocc.passes.param_uses import ParamUses, analyze

from zerocc.errors import PlanError
from zerocc.ir import (
    GATHERED,
    GRAD_SHARD,
    PARAM,
    copy_node,
    emit,
    emit_collective,
    info,
    state_placeholder,
    tag,
)
from zerocc.ops import DP_GROUP, op
from zerocc.pass_manager import PassContext, register_pass
from zerocc.state import param_specs
from zerocc.units import Unit

aten = torch.ops.aten


class _ShardRewriter:
    """Copies the captured graph into a new one, inserting the stage's flat params and comm."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, stage: int, kept: set[str]) -> None:
        self.old, self.ctx, self.stage, self.kept = gm, ctx, stage, kept
        self.units = {u.name: u for u in ctx.units}
        self.uses: ParamUses = analyze(gm, [p.fqn for p in ctx.model.trainable])
        self.param_of = {n: info(n).key for n in self.uses.unit_of}
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.flat: dict[tuple[str, str], fx.Node] = {}  # (unit, scope) -> full flat param
        self.memo: dict[tuple[fx.Node, str], fx.Node] = {}
        self.state: dict[str, dict[str, fx.Node]] = {}  # unit -> {"param", "param_shard", "grad"}

    # -- placeholders -----------------------------------------------------------------------

    def add_placeholders(self) -> None:
        like = next(n.meta["val"] for n in self.old.graph.nodes if n.op == "placeholder")
        for unit in self.ctx.units:
            nodes = {
                name: state_placeholder(self.graph, spec, like)
                for name, spec in param_specs(unit, self.stage).items()
            }
            self.state[unit.name] = nodes
            if self.stage != 3:
                self.flat[(unit.name, "resident")] = nodes["param"]
        for n in self.old.graph.nodes:
            if n.op == "placeholder" and info(n).role != PARAM:
                self.env[n] = copy_node(self.graph, n, lambda a: a)

    # -- parameter values -------------------------------------------------------------------

    def scope(self, phase: str, unit: str | None = None) -> str:
        """Which gathered copy a use in ``phase`` reads: per phase in stage 3 (one for the whole
        step for a kept unit), the resident parameters otherwise."""
        if self.stage != 3:
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
        flat = self.flat[(unit.name, self.scope(phase, unit.name))]
        return self.view_of(flat, unit, self.param_of[node], phase)

    def view_of(self, flat: fx.Node, unit: Unit, fqn: str, phase: str) -> fx.Node:
        placed = next(p for p in unit.params if p.fqn == fqn)
        where = {"phase": phase, "unit": unit.name}
        sliced = emit(
            self.graph,
            aten.slice.Tensor,
            (flat, 0, placed.offset, placed.offset + placed.numel),
            **where,
        )
        return emit(self.graph, aten.view.default, (sliced, list(placed.param.shape)), **where)

    # -- communication ----------------------------------------------------------------------

    def collective(
        self,
        start_op: str,
        args: tuple,
        unit: Unit,
        phase: str,
        nbytes: int,
        note: str,
        role: str | None = None,
    ) -> fx.Node:
        return emit_collective(
            self.graph,
            op(start_op),
            op("wait"),
            args,
            nbytes=nbytes,
            note=note,
            role=role,
            phase=phase,
            unit=unit.name,
        )

    def gather(self, unit: Unit, phase: str) -> None:
        scope = self.scope(phase, unit.name)
        if (unit.name, scope) in self.flat:  # kept gathered since forward
            return
        when = "step" if scope == "step" else phase
        flat = self.collective(
            "all_gather_start",
            (self.state[unit.name]["param"], unit.world_size, DP_GROUP),
            unit,
            phase,
            unit.padded_numel * unit.dtype.itemsize,
            f"gather {unit.name} before its first use in {when}",
            role=GATHERED,
        )
        self.flat[(unit.name, scope)] = flat

    def free(self, unit: Unit, phase: str) -> None:
        scope = self.scope(phase, unit.name)
        if scope == "step" and phase == "forward" and (unit.name, "backward") in self.uses.windows:
            return  # kept gathered for its use in backward
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

    def accumulate_grad(self, unit: Unit, fqn: str, grad: fx.Node) -> None:
        """Stages 0-1: add one parameter's gradient into its view of the full accumulator."""
        acc = self.view_of(self.state[unit.name]["grad"], unit, fqn, "backward")
        emit(self.graph, aten.add_.Tensor, (acc, grad), phase="backward", unit=unit.name)

    def reduce_unit_grad(self, unit: Unit) -> None:
        """Stages 2-3: pack the unit's gradients, reduce-scatter, add into the gradient shard."""
        grads = [
            None if self.uses.grads[p.fqn] is None else self.env[self.uses.grads[p.fqn]]
            for p in unit.params
        ]
        packed = emit(
            self.graph,
            op("pack"),
            (grads, [p.numel for p in unit.params], unit.padded_numel),
            phase="backward",
            unit=unit.name,
        )
        reduced = self.collective(
            "reduce_scatter_start",
            (packed, unit.world_size, DP_GROUP),
            unit,
            "backward",
            unit.padded_numel * unit.dtype.itemsize,
            f"reduce-scatter {unit.name}'s gradient after its last contribution",
        )
        emit(
            self.graph,
            aten.add_.Tensor,
            (self.state[unit.name]["grad"], reduced),
            phase="backward",
            unit=unit.name,
            role=GRAD_SHARD if self.ctx.boundary else None,
        )

    def reduce_full_grad(self, unit: Unit) -> None:
        """Stages 0-1, stepping micro-batch: the accumulated full gradient is reduced."""
        grad = self.state[unit.name]["grad"]
        nbytes = unit.padded_numel * unit.dtype.itemsize
        if self.stage == 0:
            self.collective(
                "all_reduce_start",
                (grad, DP_GROUP),
                unit,
                "backward",
                2 * nbytes,
                f"all-reduce {unit.name}'s gradient (DDP)",
                role=GRAD_SHARD,
            )
        else:
            self.collective(
                "reduce_scatter_start",
                (grad, unit.world_size, DP_GROUP),
                unit,
                "backward",
                nbytes,
                f"reduce-scatter {unit.name}'s accumulated gradient",
                role=GRAD_SHARD,
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
            producers = [self.uses.grads[p.fqn] for p in unit.params] if unit.trainable else []
            producers = [g for g in producers if g is not None]
            if producers:
                at.setdefault(max(producers, key=order.__getitem__), []).append(unit)
        return at

    def run(self) -> fx.Graph:
        self.add_placeholders()
        complete = self.last_contribution()
        grad_of = {}
        for fqn, g in self.uses.grads.items():
            if g is not None:
                grad_of.setdefault(g, []).append(fqn)
        unit_of_fqn = {p.fqn: u for u in self.ctx.units for p in u.params}
        output = None
        for node in self.old.graph.nodes:
            if node.op == "placeholder" or node in self.uses.derived:
                continue
            if node.op == "output":
                output = node
                continue
            phase = info(node).phase
            if self.stage == 3:
                for unit_name in self.uses.starting_at(node):
                    self.gather(self.units[unit_name], phase)
            self.env[node] = copy_node(self.graph, node, lambda a, ph=phase: self.value(a, ph))
            if self.stage <= 1:
                for fqn in grad_of.get(node, []):
                    self.accumulate_grad(unit_of_fqn[fqn], fqn, self.env[node])
            for unit in complete.get(node, []):
                if self.stage >= 2:
                    self.reduce_unit_grad(unit)
                elif self.stage == 0 and self.ctx.boundary:
                    self.reduce_full_grad(unit)
            if self.stage == 3:
                for unit_name in self.uses.ending_at(node):
                    self.free(self.units[unit_name], phase)
        if self.stage == 1 and self.ctx.boundary:
            reached = {u.name for units in complete.values() for u in units}
            for unit in self.ctx.units:
                if unit.name in reached:
                    self.reduce_full_grad(unit)
        self.graph.output(self.env[output.args[0][0]])
        for node in self.graph.nodes:
            if info(node).role == GRAD_SHARD:
                tag(node, no_grad=self.unreached_ranges(self.units[info(node).unit]))
        return self.graph

    def unreached_ranges(self, unit: Unit) -> tuple[int, ...]:
        """(offset, numel) pairs of the unit's parameters the loss does not reach."""
        pairs = [(p.offset, p.numel) for p in unit.params if self.uses.grads[p.fqn] is None]
        return tuple(x for pair in pairs for x in pair)


def kept_gathered(
    units: list[Unit], patterns: list[str], below_mb: float | None, itemsize: int
) -> set[str]:
    """Names of the units kept gathered for the whole step: those whose name (``root`` for the
    root unit) matches a pattern, and those smaller than ``below_mb`` when gathered."""
    kept = set()
    for pattern in patterns:
        hits = {u.name for u in units if fnmatch.fnmatchcase(u.key, pattern)}
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
        "stage": plan.zero.stage,
        "keep_gathered": plan.units.keep_gathered,
        "keep_gathered_below_mb": plan.units.keep_gathered_below_mb,
        "itemsize": plan.precision.dtype("param").itemsize,
    }


@register_pass(
    "shard",
    requires=("units",),
    produces=("sharded_params", "grad_shards"),
    options=_options,
)
def shard(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    stage: int,
    keep_gathered: list[str] = (),
    keep_gathered_below_mb: float | None = None,
    itemsize: int = 4,
) -> fx.GraphModule:
    """Flatten each unit's parameters and insert ZeRO-``stage`` gathers, frees and reductions."""
    kept = kept_gathered(ctx.units, list(keep_gathered), keep_gathered_below_mb, itemsize)
    graph = _ShardRewriter(gm, ctx, stage, kept if stage == 3 else set()).run()
    return fx.GraphModule(gm, graph)
