"""The update of an optimizer that needs whole matrices (Muon), emitted per unit by the optimizer
pass: each matrix orthogonalized once, by the rank that owns it.

Per unit, on the rank's gradient shard (the whole flat at stage 0):

1. ``muon_momentum_``: the momentum and the update it gives (elementwise, on the shard; the
   momentum buffer is a flat shard like AdamW's moments, so checkpoints save, load and reshard
   it as theirs);
2. stages 1-3: the update's shards all-gathered over the unit's group (every rank has the
   unit's whole update; its owner reads each matrix);
3. ``muon_orthogonalize``: each matrix this rank owns (:mod:`.owners`), zeros elsewhere;
4. a reduce-scatter (stages 1-3) or all-reduce (stage 0) over the group: each rank's part of
   every orthogonalized matrix, from its owner alone (the others add zeros: exact);
5. ``muon_apply_``: the matrices' part of the shard, with each matrix's adjusted rate;
6. ``adamw_`` for the unit's other parameters (each AdamW group's values), the Muon spans and
   the parameters the loss does not reach skipped.

The exchange moves twice the unit's flat in fp32 per step (an all-gather and a reduce-scatter),
as much again as a stage-2 step's gradient traffic; the orthogonalization runs once per matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.names import glob_matches
from zerocc.compiler.passes.support.owners import OwnedMatrix, muon_params, owned_matrices
from zerocc.compiler.plan import OptimizerConfig, ZeroConfig
from zerocc.compiler.plan.muon import ADAMW_EPS, NS_COEFFICIENTS, NS_STEPS
from zerocc.compiler.units import Unit
from zerocc.errors import PlanError
from zerocc.ir.nodes import emit, emit_collective, info
from zerocc.ir.ops import op
from zerocc.ir.owned_update_ops import adjusted_ratio

aten = torch.ops.aten


@dataclass(frozen=True)
class AdamWPart:
    """The AdamW values of a group of a Muon plan's other parameters."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class MuonPlan:
    """What a Muon plan's updates read: the optimizer's values, each unit's Muon matrices with
    their owners, and the AdamW values of every other parameter (by FQN)."""

    config: OptimizerConfig
    matrices: dict[str, list[OwnedMatrix]]
    adamw: dict[str, AdamWPart]

    @staticmethod
    def of(config: OptimizerConfig, model: ModelInfo, units: list[Unit]) -> MuonPlan:
        """The plan's groups resolved over the model's parameters and ``units``."""
        groups = list(getattr(config, "groups", None) or [])
        muon = muon_params(model, [(g.params, g.name) for g in groups])
        ranks = max((u.world_size for u in units), default=1)
        default = AdamWPart(config.lr, tuple(config.betas), ADAMW_EPS, config.weight_decay)
        adamw: dict[str, AdamWPart] = {}
        for p in model.trainable:
            if p.fqn in muon:
                continue
            group = next((g for g in groups if any(_matches(a, g.params) for a in p.aliases)), None)
            adamw[p.fqn] = default if group is None else AdamWPart(
                group.lr or default.lr,
                tuple(group.betas or default.betas),
                group.eps or default.eps,
                default.weight_decay if group.weight_decay is None else group.weight_decay,
            )  # fmt: skip
        return MuonPlan(config, owned_matrices(units, muon, ranks), adamw)


def owned_plan(ctx: Any, config: OptimizerConfig) -> MuonPlan | None:
    """The plan's owned updates, for an optimizer that needs whole tensors (Muon); None for
    an elementwise one. Refuses the layouts it is not built for (:func:`refuse_unbuilt`)."""
    if not config.kind.whole_tensors:
        return None
    refuse_unbuilt(ctx)
    return MuonPlan.of(config, ctx.model, ctx.units)


def emit_unit(
    graph: fx.Graph,
    plan: MuonPlan,
    zero: ZeroConfig,
    unit: Unit,
    grads: list[fx.Node],
    weights: tuple[fx.Node, fx.Node | None],
    states: list[fx.Node],
    step: fx.Node | None,
    lr: fx.Node,
    checks: tuple[fx.Node | None, fx.Node | None],
    scale: float,
) -> None:
    """The owned update of ``unit`` from each of its ``grad_shard`` nodes: ``weights`` (the
    weights the update writes, the compute copy or None), ``states`` (its optimizer states'
    placeholders, in the order the optimizer keeps them), ``checks`` (the clip coefficient and
    the overflow flag, each or None)."""
    names = plan.config.kind.states_of(plan.config.hyper())
    update = UnitUpdate(unit, *weights, dict(zip(names, states, strict=True)), step, lr,
                        *checks, scale)  # fmt: skip
    for grad in grads:
        emit_muon_update(graph, plan, zero, update, grad)


def _matches(name: str, globs: list[str]) -> bool:
    return any(glob_matches(name, g) for g in globs)


def refuse_unbuilt(ctx: Any) -> None:
    """A Muon plan under a layout whose update is not built (tensor, pipeline or expert
    parallelism; offloaded optimizer states) is a :class:`PlanError` naming the pair."""
    plan = ctx.plan
    pairs = [
        ("parallel.tp", plan.parallel.tp > 1),
        ("parallel.pp", plan.parallel.pp > 1),
        ("parallel.ep", plan.parallel.ep > 1),
        ("offload", plan.offload.enabled),
    ]
    for name, on in pairs:
        if on:
            raise PlanError(
                f"optimizer.name: muon with {name}: Muon's owned update is built for data "
                "parallelism (zero.stage 0-3, hybrid sharding) only; use adamw with "
                f"{name}, or muon without it"
            )


@dataclass
class UnitUpdate:
    """What one unit's update reads and writes (the optimizer pass's placeholders)."""

    unit: Unit
    target: fx.Node  # the weights the update writes: the master, else the parameter (shard)
    copy: fx.Node | None  # the compute-dtype copy (mixed precision)
    states: dict[str, fx.Node]  # momentum_buffer, exp_avg, exp_avg_sq
    step: fx.Node | None
    lr: fx.Node
    coef: fx.Node | None
    found_inf: fx.Node | None
    scale: float


def emit_muon_update(
    graph: fx.Graph, plan: MuonPlan, zero: ZeroConfig, update: UnitUpdate, grad: fx.Node
) -> None:
    """The update of ``update.unit`` from one ``grad_shard`` node: its flat shard (or the whole
    flat), or one parameter's gradient (``span``: one rank without accumulation)."""
    unit, span = update.unit, info(grad).span
    matrices = plan.matrices.get(unit.name, [])
    if span is not None:
        _emit_one_param(graph, plan, update, grad, span, matrices)
        return
    unreached = _ranges(info(grad).no_grad)
    matrices = [m for m in matrices if (m.offset, m.numel) not in unreached]
    sharded = zero.shards_optimizer and unit.world_size > 1
    exchanged = unit.world_size > 1
    rank = None
    if exchanged:
        rank = emit(graph, op("group_rank"), (grad, unit.group), unit=unit.name, phase="optimizer")
    copy = update.copy
    if matrices:
        no_adamw = not any(p.fqn in plan.adamw for p in unit.params)
        _emit_matrices(graph, plan, update, grad, matrices, rank, sharded, exchanged,
                       copy if no_adamw else None)  # fmt: skip
        if no_adamw:
            return
    skip = [*info(grad).no_grad, *(x for m in matrices for x in (m.offset, m.numel))]
    _emit_adamw(graph, plan, update, update.target, grad, update.states, copy, skip,
                unit.group if zero.shards_optimizer else None)  # fmt: skip


def _ranges(flat: tuple[int, ...]) -> set[tuple[int, int]]:
    return set(zip(flat[::2], flat[1::2], strict=True))


def _emit_matrices(
    graph: fx.Graph,
    plan: MuonPlan,
    update: UnitUpdate,
    grad: fx.Node,
    matrices: list[OwnedMatrix],
    rank: fx.Node | None,
    sharded: bool,
    exchanged: bool,
    copy: fx.Node | None,
) -> None:
    """Steps 1-5 of the module's docstring for the unit's Muon ``matrices``."""
    config, unit = plan.config, update.unit
    where = {"unit": unit.name, "phase": "optimizer"}
    momentum = emit(graph, op("muon_momentum_"), (
        update.states["momentum_buffer"], grad, update.coef, update.found_inf, update.scale,
        config.momentum, config.nesterov,
    ), note="Muon's momentum and update, elementwise on the shard", **where)  # fmt: skip
    full = momentum
    nbytes = unit.padded_numel * 4
    if sharded:
        full = emit_collective(
            graph, op("all_gather_start"), op("wait"), (momentum, unit.world_size, unit.group),
            nbytes=nbytes, note=f"all-gather {unit.name}'s Muon update: each owner's matrices "
            "whole", **where,
        )  # fmt: skip
    owners = [x for m in matrices for x in _matrix_fields(m, exchanged)]
    coefficients = list(getattr(config, "ns_coefficients", None) or NS_COEFFICIENTS)
    steps = getattr(config, "ns_steps", None) or NS_STEPS
    ortho = emit(graph, op("muon_orthogonalize"), (full, rank, owners, coefficients, steps,
                                                   config.eps),
                 note=f"Newton-Schulz of the {len(matrices)} matrices this rank owns",
                 **where)  # fmt: skip
    if sharded:
        ortho = emit_collective(
            graph, op("reduce_scatter_start"), op("wait"), (ortho, unit.world_size, unit.group),
            nbytes=nbytes, note=f"reduce-scatter {unit.name}'s orthogonalized matrices from "
            "their owners", **where,
        )  # fmt: skip
    elif exchanged:
        ortho = emit_collective(
            graph, op("all_reduce_start"), op("wait"), (ortho, unit.group), nbytes=2 * nbytes,
            note=f"all-reduce {unit.name}'s orthogonalized matrices from their owners", **where,
        )  # fmt: skip
    adjust = getattr(config, "adjust_lr_fn", None)
    spans = [x for m in matrices for x in (m.offset, m.numel)]
    ratios = [adjusted_ratio(adjust, m.shape) for m in matrices]
    emit(graph, op("muon_apply_"), (
        update.target, ortho, update.found_inf, copy, update.lr, config.weight_decay,
        rank if sharded else None, spans, ratios,
    ), **where)  # fmt: skip


def _matrix_fields(matrix: OwnedMatrix, exchanged: bool) -> tuple[int, ...]:
    rows, cols = matrix.shape[-2:]
    batch = matrix.numel // (rows * cols)
    return (matrix.offset, batch, rows, cols, matrix.owner if exchanged else -1)


def _emit_adamw(
    graph: fx.Graph,
    plan: MuonPlan,
    update: UnitUpdate,
    target: fx.Node,
    grad: fx.Node,
    states: dict[str, fx.Node],
    copy: fx.Node | None,
    skip: list[int],
    shard_group: str | None,
    params: list[str] | None = None,
) -> None:
    """One ``adamw_`` per AdamW group among the unit's other parameters (``params``: these
    alone, by FQN), each skipping every range not its own."""
    unit = update.unit
    names = params if params is not None else [p.fqn for p in unit.params]
    parts: dict[AdamWPart, list[str]] = {}
    for fqn in names:
        if fqn in plan.adamw:
            parts.setdefault(plan.adamw[fqn], []).append(fqn)
    placed = {p.fqn: (p.offset, p.numel) for p in unit.params}
    for n, (part, fqns) in enumerate(parts.items()):
        others = [x for f, r in placed.items() if f in names and f not in fqns for x in r]
        lr = _rate(graph, plan, update, part)
        last = n == len(parts) - 1
        args = (
            target, grad, states["exp_avg"], states["exp_avg_sq"], update.step, update.coef,
            update.found_inf, copy if last else None, update.scale, lr, part.betas[0],
            part.betas[1], part.eps, part.weight_decay, [*skip, *others], shard_group,
        )  # fmt: skip
        emit(graph, op("adamw_"), args, unit=unit.name, phase="optimizer")


def _emit_one_param(
    graph: fx.Graph,
    plan: MuonPlan,
    update: UnitUpdate,
    grad: fx.Node,
    span: tuple[int, int],
    matrices: list[OwnedMatrix],
) -> None:
    """One parameter's update from its own gradient (one rank, no accumulation): Muon on the
    whole matrix, or AdamW, on the parameter's slice of the flat state."""
    offset, numel = span
    where = {"unit": update.unit.name, "phase": "optimizer"}

    def sliced(node: fx.Node | None) -> fx.Node | None:
        if node is None:
            return None
        return emit(graph, aten.slice.Tensor, (node, 0, offset, offset + numel), **where)

    states = {k: sliced(v) for k, v in update.states.items()}
    target, copy = sliced(update.target), sliced(update.copy)
    matrix = next((m for m in matrices if m.offset == offset), None)
    if matrix is not None:
        one = replace(update, target=target, copy=copy, states=states)
        local = OwnedMatrix(matrix.fqn, matrix.unit, 0, matrix.shape, -1)
        _emit_matrices(graph, plan, one, grad, [local], None, False, False, copy)
        return
    fqn = next(p.fqn for p in update.unit.params if p.offset == offset)
    part = plan.adamw[fqn]
    emit(graph, op("adamw_"), (
        target, grad, states["exp_avg"], states["exp_avg_sq"], update.step, update.coef,
        update.found_inf, copy, update.scale, _rate(graph, plan, update, part), part.betas[0],
        part.betas[1], part.eps, part.weight_decay, [], None,
    ), **where)  # fmt: skip


def _rate(graph: fx.Graph, plan: MuonPlan, update: UnitUpdate, part: AdamWPart) -> fx.Node:
    """The step's rate for an AdamW group: the schedule's, scaled by the group's lr over the
    optimizer's (as torch's schedulers scale each group's own)."""
    if part.lr == plan.config.lr:
        return update.lr
    return emit(graph, aten.mul.Tensor, (update.lr, part.lr / plan.config.lr),
                unit=update.unit.name, phase="optimizer")  # fmt: skip
