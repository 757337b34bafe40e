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

from zerocc.compiler.parallel.tensor_parallel import TensorParallel
from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.passes.support.gradients import solo
from zerocc.compiler.plan import OptimizerConfig, ZeroConfig
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
from zerocc.ir.ops import DP_GROUP, EP_GROUP, PP_GROUP, REPLICATE_GROUP, TP_GROUP, op

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
    step_spec = layout.get(STEP_SPEC.key)  # AdamW's step counter
    step = state_placeholder(graph, step_spec, like) if step_spec is not None else None
    lr = state_placeholder(graph, layout.get(LR_SPEC.key), like)  # the schedule's, per step
    scale = 1.0 / (ctx.mesh.data_parallel * grad_accumulation)
    # Ranks hold slices of the gradient (stages 1-3): its checks are summed over ranks.
    sliced = zero.shards_optimizer and ctx.mesh.data_parallel > 1
    where = {"phase": "optimizer"}
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        coef, grads = None, [g for u in units for g in grad_shards[u.name]]
        total = None
        clip, tp = config.grad_clip is not None, ctx.tensor_parallel
        stages = ctx.mesh.pp > 1  # pipeline ranks each hold some units: agree across them
        # Experts' units whose gradients lie beyond what the norm and flags are summed over:
        # under hybrid sharding (dp: a shard group) their shards on the other replicas' ranks;
        # at stage 0 (nothing summed) the other experts, on the other ep ranks.
        beyond_group = EP_GROUP if not zero.shards_optimizer else REPLICATE_GROUP
        beyond = {
            u.name for u in units
            if u.group != DP_GROUP and (ctx.mesh.hybrid or not zero.shards_optimizer)
        }  # fmt: skip
        if check_nonfinite:  # (the norm from the same read, unless tp ranks, stages or
            # experts beyond the dp group hold parts)
            found_inf, total = _check_nonfinite(
                graph, output, grads, scale, clip and tp is None and not stages and not beyond,
                sliced, tp is not None, beyond_group if beyond else None,
            )  # fmt: skip
        # A tied unit's norm is counted by one of the pipeline ranks holding it.
        counted = [u for u in units if ctx.tied_norm or u.name not in ctx.tied]
        if clip and tp is not None:
            total = _split_norm(graph, counted, grad_shards, scale, tp, zero, sliced, beyond,
                                beyond_group)  # fmt: skip
        elif clip and total is None:
            parts = [
                emit(graph, op("sum_squares"), ([g for u in part for g in grad_shards[u.name]],
                                                scale), **where)
                for part in _dense_and_beyond(counted, beyond) if part
            ]  # fmt: skip
            total = _summed(graph, parts, any(u.name in beyond for u in counted), beyond_group)
            if sliced:  # each rank holds a slice of the gradient: sum the squares over ranks
                total = _all_reduce(graph, total, 1, "all-reduce the squared grad norm")
        if stages and check_nonfinite:
            found_inf, total = _agree_across_stages(graph, output, found_inf, total)
        elif stages and total is not None:
            total = _all_reduce(
                graph, total, 1, "sum the squared grad norm of every stage", PP_GROUP
            )
        if clip:
            coef = emit(graph, op("clip_coef"), (total, config.grad_clip), **where)
        for u in units:
            param = by_role[PARAM_SHARD].get(u.name, by_role[PARAM_FULL].get(u.name))
            # Mixed precision: update the master weights, write their compute-dtype copy.
            master = by_role[MASTER].get(u.name)
            target, copy = (master, param) if master is not None else (param, None)
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
    """One ``adamw_`` / ``sgd_`` of a flat shard (or of one parameter's slice of it)."""
    skip = list(info(update.grad).no_grad)
    where = {"unit": unit.name, "phase": "optimizer"}
    shard_group = unit.group if zero.shards_optimizer else None
    if config.name == "adamw":
        m, v = update.states
        args = (
            update.weights,
            update.grad,
            m,
            v,
            step,
            coef,
            found_inf,
            update.copy,
            scale,
            lr,
            config.betas[0],
            config.betas[1],
            config.eps,
            config.weight_decay,
            skip,
            shard_group,
        )
        emit(graph, op("adamw_"), args, **where)
    else:
        buf = update.states[0] if update.states else None
        args = (
            update.weights,
            update.grad,
            buf,
            coef,
            found_inf,
            update.copy,
            scale,
            lr,
            config.momentum,
            config.weight_decay,
            skip,
            shard_group,
        )
        emit(graph, op("sgd_"), args, **where)


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


def _agree_across_stages(
    graph: fx.Graph, output: fx.Node, found_inf: fx.Node, total: fx.Node | None
) -> tuple[fx.Node, fx.Node | None]:
    """Pipeline ranks each checked (and measured) the gradients of their own stages: one
    all-reduce over the ``pp`` group makes the overflow flag (and the squared norm) the whole
    model's, so that every stage skips the same steps and clips by the same norm."""
    where = {"phase": "optimizer"}
    zero = emit(graph, aten.zeros_like.default, (found_inf,), **where)
    parts = emit(graph, aten.stack.default, ([found_inf, total if total is not None else zero],),
                 **where)  # fmt: skip
    note = "all-reduce the overflow flag and the squared norm over the pipeline's stages"
    agreed = _all_reduce(graph, parts, 2, note, PP_GROUP)
    tag(found_inf, role=None)
    found = emit(graph, aten.select.int, (agreed, 0, 0), role=FOUND_INF, **where)
    loss, flags, _ = output.args[0]
    output.args = ((loss, flags, found),)
    norm = emit(graph, aten.select.int, (agreed, 0, 1), **where) if total is not None else None
    return found, norm


def _dense_and_beyond(units: list[Unit], beyond: set[str]) -> tuple[list[Unit], list[Unit]]:
    """``units`` as those of the dp group and those with shards beyond it (see ``beyond``)."""
    return [u for u in units if u.name not in beyond], [u for u in units if u.name in beyond]


def _summed(graph: fx.Graph, parts: list[fx.Node], last_beyond: bool, group: str) -> fx.Node:
    """The sum of the squared-norm ``parts`` (the dense units', then, ``last_beyond``, the
    experts' whose gradients lie beyond the dp group): the experts' part first summed over
    ``group``, so that every expert's gradient is counted once in the sum over dp after."""
    where = {"phase": "optimizer"}
    if last_beyond:
        note = f"all-reduce the experts' squared grad norm over {group}"
        parts[-1] = _all_reduce(graph, parts[-1], 1, note, group)
    total = parts[0]
    for part in parts[1:]:
        total = emit(graph, aten.add.Tensor, (total, part), **where)
    return total


def _split_norm(
    graph: fx.Graph,
    units: list[Unit],
    grad_shards: dict[str, list[fx.Node]],
    scale: float,
    tp: TensorParallel,
    zero: ZeroConfig,
    sliced: bool,
    beyond: set[str],
    beyond_group: str,
) -> fx.Node:
    """The squared gradient norm under tensor parallelism: each rank's part, in which the
    parameters every tp rank holds alike count 1/tp, summed over the ranks of ``dp`` (when
    they hold slices of the gradient) and ``tp``, so that every element counts once (the
    experts' units of ``beyond`` over ``beyond_group`` first)."""
    where = {"phase": "optimizer"}
    totals = []
    for part in _dense_and_beyond(units, beyond):
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
                parts.append(emit(graph, op("sum_squares_tp"), args, unit=u.name, **where))
        if parts:
            totals.append(_summed(graph, parts, False, beyond_group))
    total = _summed(graph, totals, any(u.name in beyond for u in units), beyond_group)
    if sliced:
        total = _all_reduce(graph, total, 1, "all-reduce the squared grad norm (dp)")
    note = "all-reduce the squared grad norm over the tp ranks' slices"
    return _all_reduce(graph, total, 1, note, TP_GROUP)


def _check_nonfinite(
    graph: fx.Graph,
    output: fx.Node,
    grads: list[fx.Node],
    scale: float,
    clip: bool,
    sliced: bool,
    split: bool,
    beyond: str | None = None,
) -> tuple[fx.Node, fx.Node | None]:
    """Flag every unit whose reduced gradient holds an inf or NaN, on every rank; returns the
    flag that gates the updates (returned by the program after the flags) and, when ``clip``,
    the squared norm from the same read. ``split``: tensor parallelism, whose ranks each
    check their slices: the flags are summed over the ``tp`` group too."""
    where = {"phase": "optimizer"}
    flags = emit(
        graph,
        op("nonfinite_flags"),
        (grads, scale, clip),
        note="1.0 per unit whose reduced gradient holds an inf/NaN"
        + ("; last, the squared norm the clip reads" if clip else ""),
        **where,
    )
    if sliced:  # each rank checked its slice of the gradient
        flags = _all_reduce(
            graph,
            flags,
            len(grads) + clip,
            "all-reduce the non-finite flags"
            + (" and the squared norm" if clip else "")
            + ": every rank skips or stops at the same step",
        )
    if split:
        note = "all-reduce the non-finite flags over the tp ranks' slices"
        flags = _all_reduce(graph, flags, len(grads) + clip, note, TP_GROUP)
    if beyond is not None:  # experts' gradients beyond the dp group: all skip alike
        note = f"all-reduce the non-finite flags over {beyond} (the experts' gradients)"
        flags = _all_reduce(graph, flags, len(grads) + clip, note, beyond)
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
