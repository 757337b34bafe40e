"""optimizer: the update of each unit's shard, at the end of the micro-batch that steps.

Acts on the ``grad_shard`` tags of the shard pass. Per unit, in order: the gradient is scaled
by 1/(ranks × micro-batches) (collectives sum, the update takes the mean), multiplied by the
global-norm clip coefficient when ``grad_clip`` is set (the squared norm is all-reduced across
ranks when gradients are sharded), and the update runs on the rank's shard only; stages 1-2 then
all-gather the updated shards into the replicated parameters, and the gradient accumulator (with
``grad_accumulation`` > 1) is reset. Programs of micro-batches that do not step are left as they
are. On one rank nothing is communicated; without accumulation there the shard pass leaves one
gradient per parameter (``span``) and each parameter's slice of the flat state is updated from
it, so that no gradient is copied into a flat buffer.

Without loss scaling (whose unscale already finds overflows, see the precision pass), one op
reads every reduced gradient shard before the first update: ``nonfinite_flags``, one flag per
unit (1.0 when its gradient holds an inf or NaN), with the clip's squared norm as one more
entry when clipping, from the same read. The vector is all-reduced when ranks hold slices (one
collective for both), and its max gates every update as ``found_inf``: such a step writes
nothing on any rank. The program returns (loss, flags, found_inf); the TrainStep skips or stops
(``precision.on_nonfinite``), so both modes run the same program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from zerocc.compiler.parallel.dims import Spread
from zerocc.compiler.parallel.tensor_parallel import TensorParallel
from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.passes.support.gradients import solo
from zerocc.compiler.passes.support.owned_update import emit_unit, owned_plan
from zerocc.compiler.plan import OptimizerConfig, ZeroConfig
from zerocc.compiler.plan.optimizers import flat_hyper
from zerocc.compiler.state import LR_SPEC, STEP_SPEC, declare_optimizer_state
from zerocc.compiler.units import Unit
from zerocc.ir.kinds import Role
from zerocc.ir.nodes import (
    FOUND_INF,
    GRAD,
    GRAD_SHARD,
    MASTER,
    OPTIM_STATE,
    PARAM_FULL,
    PARAM_SHARD,
    emit,
    emit_collective,
    info,
    nodes_with_role,
    placeholders,
    state_placeholder,
    tag,
    val,
)
from zerocc.ir.ops import DP_GROUP, MAX_UPDATE_STATES, op

aten = torch.ops.aten


@register_pass(
    "optimizer",
    requires=("grad_shards",),
    provides=("optimizer_update",),
    options=lambda plan: {
        "config": plan.optimizer,
        "zero": plan.zero,
        "grad_accumulation": plan.grad_accumulation,
        "check_nonfinite": plan.precision.scaling == "none",
    },
    declares=declare_optimizer_state,
)
def optimizer(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    config: OptimizerConfig,
    zero: ZeroConfig,
    grad_accumulation: int,
    check_nonfinite: bool,
) -> fx.GraphModule:
    """Insert the non-finite check, clipping, the sharded optimizer update and (stages 1-2) the
    updated-param gather."""
    grad_shards: dict[str, list[fx.Node]] = {}  # in the order backward completes them
    for node in nodes_with_role(gm, GRAD_SHARD):
        grad_shards.setdefault(info(node).unit, []).append(node)
    if not ctx.boundary or not grad_shards:
        return gm
    graph = gm.graph
    by_role = {
        role: {info(n).unit: n for n in placeholders(gm, role)}
        for role in (PARAM_FULL, PARAM_SHARD, GRAD, MASTER)
    }
    found_inf = next(iter(nodes_with_role(gm, FOUND_INF)), None)
    like = next(iter(grad_shards.values()))[0].meta["val"]
    # Updated in the order their gradients are complete: a host update's gradient is copied
    # out in that order, so the first update waits for the first copy, not for all of them.
    by_name = {u.name: u for u in ctx.units}
    units = [by_name[name] for name in grad_shards]
    layout = ctx.layout  # as the pass declared it (`declare_optimizer_state`)
    states = {
        u.name: [
            state_placeholder(graph, spec, like)
            for spec in layout.of_unit(u).values()
            if spec.role == OPTIM_STATE
        ]
        for u in units
    }
    step_spec = layout.get(STEP_SPEC.key)  # the step counter (AdamW's bias corrections, ...)
    step = state_placeholder(graph, step_spec, like) if step_spec is not None else None
    lr = state_placeholder(graph, layout.get(LR_SPEC.key), like)  # the schedule's, per step
    scale = 1.0 / (ctx.mesh.data_parallel * grad_accumulation)
    owned = owned_plan(ctx, config)  # Muon: each matrix updated whole, by the rank owning it
    # Where each unit's gradient lies in parts, as the mesh says (its shards, tp slices,
    # other stages, other experts): the checks are summed over those groups.
    sums = _Sums.of(ctx, units, zero)
    where = {"phase": "optimizer"}
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        coef, grads = None, [g for u in units for g in grad_shards[u.name]]
        total = None
        clip, tp = config.grad_clip is not None, ctx.tensor_parallel
        if check_nonfinite:  # (the norm from the same read, unless it counts shared elements
            # once (tp), or other ranks hold other units or parts beyond the common groups)
            from_flags = clip and tp is None and not sums.across and not sums.beyond
            found_inf, total = _check_nonfinite(graph, output, grads, scale, from_flags, sums)
        # A tied unit's norm is counted by one of the pipeline ranks holding it.
        counted = [u for u in units if ctx.tied_norm or u.name not in ctx.tied]
        if clip and tp is not None:
            total = _split_norm(graph, counted, grad_shards, scale, tp, zero, sums)
        elif clip and total is None:
            parts = [
                (emit(graph, op("sum_squares"), ([g for u in part for g in grad_shards[u.name]],
                                                 scale), **where), extras)
                for extras, part in sums.parts(counted)
            ]  # fmt: skip
            total = _summed(graph, parts, sums.within)
        for spread in sums.across:  # other ranks hold other units: agree on the whole model's
            if check_nonfinite:
                found_inf, total = _agree_across(graph, output, found_inf, total, spread)
            elif total is not None:
                note = f"sum the squared grad norm over {spread.what}"
                total = _all_reduce(graph, total, 1, note, spread.group)
        if clip:
            coef = emit(graph, op("clip_coef"), (total, config.grad_clip), **where)
        for u in units:
            param = by_role[PARAM_SHARD].get(u.name, by_role[PARAM_FULL].get(u.name))
            # Mixed precision: update the master weights, write their compute-dtype copy.
            master = by_role[MASTER].get(u.name)
            target, copy = (master, param) if master is not None else (param, None)
            if owned is not None:
                emit_unit(graph, owned, zero, u, grad_shards[u.name], (target, copy),
                          states[u.name], step, lr, (coef, found_inf), scale)  # fmt: skip
                _after_update(graph, ctx, zero, u, param, by_role)
                continue
            for grad in grad_shards[u.name]:
                span = info(grad).span
                tensors = [target, *states[u.name], copy]
                if span is not None:  # one parameter's gradient: update its slice of the flat
                    tensors = [_slice(graph, t, span, u.name) for t in tensors]
                update = _Update(tensors[0], grad, tensors[1:-1], tensors[-1])
                _emit_update(graph, config, u, update, step, lr, coef, found_inf, scale, zero)
            _after_update(graph, ctx, zero, u, param, by_role)
    return gm


def _after_update(
    graph: fx.Graph,
    ctx: PassContext,
    zero: ZeroConfig,
    unit: Unit,
    param: fx.Node,
    by_role: dict[Role, dict[str, fx.Node]],
) -> None:
    """After a unit's update: (stages 1-2) all-gather its updated shards into the full
    parameter every rank computes with; reset its gradient accumulator, if it has one."""
    where = {"phase": "optimizer"}
    if zero.shards_optimizer and not zero.shards_params and not solo(unit):
        full = by_role[PARAM_FULL][unit.name]
        emit_collective(
            graph,
            op("all_gather_into_start"),
            op("wait"),
            (full, param, unit.group),
            nbytes=unit.padded_numel * val(full).dtype.itemsize,
            unit=unit.name,
            note=f"all-gather {unit.name}'s updated shards",
            **where,
        )
    if unit.name in by_role[GRAD]:
        emit(
            graph,
            torch.ops.aten.zero_.default,
            (by_role[GRAD][unit.name],),
            unit=unit.name,
            note="reset the gradient accumulator",
            **where,
        )


@dataclass
class _Update:
    """What one update reads and writes: the weights, the gradient, the optimizer states and
    the compute-dtype copy (mixed precision)."""

    weights: fx.Node
    grad: fx.Node
    states: list[fx.Node]
    copy: fx.Node | None


def _slice(graph: fx.Graph, flat: fx.Node | None, span: tuple[int, int], unit: str):
    """The view of ``flat`` that holds one parameter (``span``: offset, numel)."""
    if flat is None:
        return None
    offset, numel = span
    args = (flat, 0, offset, offset + numel)
    return emit(graph, aten.slice.Tensor, args, unit=unit, phase="optimizer")


def _emit_update(
    graph: fx.Graph,
    config: OptimizerConfig,
    unit: Unit,
    update: _Update,
    step: fx.Node | None,
    lr: fx.Node,
    coef: fx.Node | None,
    found_inf: fx.Node | None,
    scale: float,
    zero: ZeroConfig,
) -> None:
    """One update of a flat shard (or of one parameter's slice of it): AdamW's and plain SGD's
    own ops (their kernels tuned per kernel set), any other elementwise optimizer of the
    registry as ``optim_update_`` (torch's functional form, named with its fields' values)."""
    skip = list(info(update.grad).no_grad)
    where = {"unit": unit.name, "phase": "optimizer"}
    shard_group = unit.group if zero.shards_optimizer else None
    head = (update.weights, update.grad)
    tail = (skip, shard_group)
    if config.name == "adamw":
        m, v = update.states
        hyper = (config.betas[0], config.betas[1], config.eps, config.weight_decay)
        args = (*head, m, v, step, coef, found_inf, update.copy, scale, lr, *hyper, *tail)
        emit(graph, op("adamw_"), args, **where)
    elif config.name == "sgd" and not config.nesterov and not config.dampening:
        buf = update.states[0] if update.states else None
        hyper = (config.momentum, config.weight_decay)
        args = (*head, buf, coef, found_inf, update.copy, scale, lr, *hyper, *tail)
        emit(graph, op("sgd_"), args, **where)
    else:
        states = [*update.states, *[None] * (MAX_UPDATE_STATES - len(update.states))]
        hyper = flat_hyper(config.kind, config.hyper())
        args = (*head, *states, step, coef, found_inf, update.copy, scale, lr, config.name,
                hyper, *tail)  # fmt: skip
        emit(graph, op("optim_update_"), args, **where)


def _all_reduce(
    graph: fx.Graph, tensor: fx.Node, numel: int, note: str, group: str = DP_GROUP
) -> fx.Node:
    return emit_collective(
        graph,
        op("all_reduce_start"),
        op("wait"),
        (tensor, group),
        nbytes=2 * 4 * numel,
        note=note,
        phase="optimizer",
    )


@dataclass(frozen=True)
class _Sums:
    """The groups the optimizer's checks are summed over, from the mesh
    (:meth:`~zerocc.compiler.parallel.mesh.Mesh.gradient_groups`): ``within``, those over
    which every unit's gradient lies in parts (its shards, its tp slices); ``across``, those
    whose ranks hold other units (a pipeline's other stages); ``beyond``, by unit, the groups
    over which its gradient lies beyond those (an experts unit's other shards or experts)."""

    within: tuple[Spread, ...]
    across: tuple[Spread, ...]
    beyond: dict[str, tuple[Spread, ...]]

    @staticmethod
    def of(ctx: PassContext, units: list[Unit], zero: ZeroConfig) -> _Sums:
        spreads = {u.name: ctx.mesh.gradient_groups(u.group, zero.shards_optimizer) for u in units}
        first = spreads[units[0].name]
        common = tuple(s for s in first if all(s in v for v in spreads.values()))
        beyond = {n: extra for n, v in spreads.items() if (extra := _minus(v, common))}
        return _Sums(
            tuple(s for s in common if s.holds == "parts"),
            tuple(s for s in common if s.holds == "units"),
            beyond,
        )

    @property
    def extras(self) -> tuple[Spread, ...]:
        """The groups beyond the common ones of any unit, once each, in the order first met."""
        return tuple(dict.fromkeys(s for extra in self.beyond.values() for s in extra))

    def parts(self, units: list[Unit]) -> list[tuple[tuple[Spread, ...], list[Unit]]]:
        """``units`` by the groups beyond the common ones their gradients lie over: those with
        none first, then each other kind (an experts unit's), in the order first met."""
        kinds: dict[tuple[Spread, ...], list[Unit]] = {(): []}
        for u in units:
            kinds.setdefault(self.beyond.get(u.name, ()), []).append(u)
        return [(extras, part) for extras, part in kinds.items() if part]


def _minus(spreads: tuple[Spread, ...], common: tuple[Spread, ...]) -> tuple[Spread, ...]:
    return tuple(s for s in spreads if s not in common)


def _agree_across(
    graph: fx.Graph, output: fx.Node, found_inf: fx.Node, total: fx.Node | None, spread: Spread
) -> tuple[fx.Node, fx.Node | None]:
    """Ranks holding other units (a pipeline's other stages) each checked (and measured) the
    gradients of their own: one all-reduce over ``spread``'s group makes the overflow flag (and
    the squared norm) the whole model's, so that every rank skips the same steps and clips by
    the same norm."""
    where = {"phase": "optimizer"}
    zero = emit(graph, aten.zeros_like.default, (found_inf,), **where)
    parts = emit(graph, aten.stack.default, ([found_inf, total if total is not None else zero],),
                 **where)  # fmt: skip
    note = f"all-reduce the overflow flag and the squared norm over {spread.what}"
    agreed = _all_reduce(graph, parts, 2, note, spread.group)
    tag(found_inf, role=None)
    found = emit(graph, aten.select.int, (agreed, 0, 0), role=FOUND_INF, **where)
    loss, flags, _ = output.args[0]
    output.args = ((loss, flags, found),)
    norm = emit(graph, aten.select.int, (agreed, 0, 1), **where) if total is not None else None
    return found, norm


def _summed(
    graph: fx.Graph, parts: list[tuple[fx.Node, tuple[Spread, ...]]], within: tuple[Spread, ...]
) -> fx.Node:
    """The sum of the squared-norm ``parts``, each first summed over the groups beyond the
    common ones its units' gradients lie over (an experts unit's: so that every expert's
    gradient is counted once), then over the common groups ``within``."""
    where = {"phase": "optimizer"}
    summed = []
    for node, extras in parts:
        for spread in extras:
            note = f"all-reduce the squared grad norm over {spread.what}"
            node = _all_reduce(graph, node, 1, note, spread.group)
        summed.append(node)
    total = summed[0]
    for part in summed[1:]:
        total = emit(graph, aten.add.Tensor, (total, part), **where)
    for spread in within:  # each rank holds a part of the gradient: sum the squares over ranks
        note = f"all-reduce the squared grad norm over {spread.what}"
        total = _all_reduce(graph, total, 1, note, spread.group)
    return total


def _split_norm(
    graph: fx.Graph,
    units: list[Unit],
    grad_shards: dict[str, list[fx.Node]],
    scale: float,
    tp: TensorParallel,
    zero: ZeroConfig,
    sums: _Sums,
) -> fx.Node:
    """The squared gradient norm under tensor parallelism: each rank's part, in which the
    parameters every tp rank holds alike count 1/tp, summed over the groups the gradients lie
    over (``sums``), so that every element counts once."""
    where = {"phase": "optimizer"}
    totals = []
    for extras, part in sums.parts(units):
        parts = []
        for u in part:
            for grad in grad_shards[u.name]:
                span = info(grad).span
                if span is None:  # the unit's flat gradient (or this rank's shard of it)
                    shared = tp.shared_ranges(u)
                else:  # one parameter's gradient
                    param = next(p for p in u.params if p.offset == span[0])
                    shared = [] if param.fqn in tp.splits else [0, span[1]]
                args = (grad, scale, shared, tp.parts,
                        u.group if zero.shards_optimizer else None)  # fmt: skip
                parts.append((emit(graph, op("sum_squares_tp"), args, unit=u.name, **where), ()))
        totals.append((_summed(graph, parts, ()), extras))
    return _summed(graph, totals, sums.within)


def _check_nonfinite(
    graph: fx.Graph,
    output: fx.Node,
    grads: list[fx.Node],
    scale: float,
    clip: bool,
    sums: _Sums,
) -> tuple[fx.Node, fx.Node | None]:
    """Flag every unit whose reduced gradient holds an inf or NaN, on every rank; returns the
    flag that gates the updates (returned by the program after the flags) and, when ``clip``,
    the squared norm from the same read. The flags are summed over the groups the gradients
    lie over in parts (``sums``: shards, tp slices, an experts unit's beyond them)."""
    where = {"phase": "optimizer"}
    flags = emit(
        graph,
        op("nonfinite_flags"),
        (grads, scale, clip),
        note="1.0 per unit whose reduced gradient holds an inf/NaN"
        + ("; last, the squared norm the clip reads" if clip else ""),
        **where,
    )
    for spread in (*sums.within, *sums.extras):  # every rank skips or stops at the same step
        note = (
            "all-reduce the non-finite flags" + (" and the squared norm" if clip else "")
            + f" over {spread.what}"
        )  # fmt: skip
        flags = _all_reduce(graph, flags, len(grads) + clip, note, spread.group)
    units = emit(graph, aten.slice.Tensor, (flags, 0, 0, len(grads)), **where)
    found_inf = emit(
        graph,
        aten.amax.default,
        (units, [0]),
        role=FOUND_INF,
        note="nonzero when a gradient is not finite: every update then writes nothing",
        **where,
    )
    output.args = ((output.args[0], flags, found_inf),)
    total = emit(graph, aten.select.int, (flags, 0, len(grads)), **where) if clip else None
    return found_inf, total
