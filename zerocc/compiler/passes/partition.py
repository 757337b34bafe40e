"""partition: parameters -> FSDP units (an analysis pass: it tags, it does not rewrite).

Unit roots are modules chosen by class name, FQN glob or size; the root module is always one.
A parameter belongs to the innermost unit root that contains every module holding it, so a tied
parameter (embedding and output head) lands in one unit covering all its uses, at their lowest
common ancestor, as FSDP does. Frozen parameters (``requires_grad=False``) form units of their
own (``<name>[frozen]``): no gradient communication and no optimizer state.

``units.blocks_per_unit: k`` puts the roots of one class under one parent (a transformer's
blocks) k to a unit, in model order: ``transformer.h.0-1`` holds blocks 0 and 1, gathered,
freed and reduced together (a k-th of the collectives, k blocks gathered at once).
"""

from __future__ import annotations

import torch
from torch import fx

from zerocc.compiler.capture import ModelInfo, ParamInfo
from zerocc.compiler.names import enclosing, glob_matches
from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.plan.parallelism import AUTO_UNITS
from zerocc.compiler.units import FROZEN, ExpertUnits, Unit
from zerocc.compiler.units import ROOT as ROOT_UNIT
from zerocc.errors import PlanError
from zerocc.ir.nodes import PARAM, info, placeholders, tag
from zerocc.ir.ops import EXPERT_DP_GROUP

ROOT = ""


def _contains(outer: str, inner: str) -> bool:
    return outer == ROOT or inner == outer or inner.startswith(outer + ".")


def _common_ancestor(modules: tuple[str, ...]) -> str:
    parts = [m.split(".") if m else [] for m in modules]
    common = []
    for level in zip(*parts, strict=False):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def _unit_root_of(param: ParamInfo, roots: set[str]) -> str:
    """The innermost root containing every module that holds ``param``: the longest dotted
    prefix of their common ancestor that is a root (a walk up its path, not over the roots:
    a 4000-layer model has 4000 of them)."""
    return next((m for m in enclosing(_common_ancestor(param.owners)) if m in roots), ROOT)


def _match_roots(model: ModelInfo, classes: list[str], modules: list[str]) -> set[str]:
    roots = {ROOT}
    present = {cls for _, cls in model.modules}
    for cls in classes:
        if cls not in present:
            raise PlanError(
                f"units.classes: no module of class {cls!r} in the model; its classes "
                f"are: {', '.join(sorted(present))}"
            )
        roots |= {fqn for fqn, c in model.modules if c == cls}
    for pattern in modules:
        hits = {fqn for fqn, _ in model.modules if fqn and glob_matches(fqn, pattern)}
        if not hits:
            examples = ", ".join(fqn for fqn, _ in model.modules[1:6])
            raise PlanError(
                f"units.modules: pattern {pattern!r} matches no module; module names "
                f"look like: {examples}"
            )
        roots |= hits
    return roots


def _add_size_roots(model: ModelInfo, roots: set[str], min_mb: float) -> None:
    """Bottom-up: a module whose parameters not yet in a unit reach ``min_mb`` becomes a unit."""
    threshold = min_mb * 2**20
    for fqn, _ in reversed(model.modules):
        if fqn in roots:
            continue
        # Parameters living under this module that no unit at or below it has claimed yet.
        pending = sum(
            p.numel * p.dtype.itemsize
            for p in model.params
            if _contains(fqn, _common_ancestor(p.owners))
            and not _contains(fqn, _unit_root_of(p, roots))
        )
        if pending >= threshold:
            roots.add(fqn)


def assign_units(
    model: ModelInfo,
    world_size: int,
    classes: list[str],
    modules: list[str],
    min_mb: float | None,
    experts: ExpertUnits | None = None,
    blocks_per_unit: int = 1,
) -> list[Unit]:
    """The units of ``model`` for the plan's ``units`` section, ordered as their parameters are
    (``auto`` among the classes: the model's repeated block, none when it has none).
    ``experts``: expert parallelism's experts modules, each a unit of its own, sharded over
    the ranks holding the same experts; ``blocks_per_unit``: sibling roots of one class
    grouped that many to a unit (experts modules are not)."""
    roots = _match_roots(model, unit_classes(model, classes), modules)
    if min_mb is not None:
        _add_size_roots(model, roots, min_mb)
    named = _grouped(model, roots, blocks_per_unit)
    if experts is not None:
        roots |= set(experts.modules)
        named |= {m: m for m in experts.modules}
    groups: dict[tuple[str, bool], list[ParamInfo]] = {}
    members: dict[str, list[str]] = {}
    for p in model.params:
        root = _unit_root_of(p, roots)
        group = named.get(root, root)
        groups.setdefault((group, p.requires_grad), []).append(p)
        held = members.setdefault(group, [])
        if root not in held:
            held.append(root)
    units = []
    for (group, trainable), params in groups.items():
        name = group or ROOT_UNIT
        name = name if trainable else f"{name}{FROZEN}"
        held = tuple(members[group]) if members[group] != [group] else ()
        if experts is not None and group in experts.modules:
            units.append(Unit.build(name, params, experts.world_size, EXPERT_DP_GROUP))
        else:
            units.append(Unit.build(name, params, world_size, modules=held))
    return units


def _grouped(model: ModelInfo, roots: set[str], k: int) -> dict[str, str]:
    """The unit each root's parameters go to: with ``k`` > 1 the roots of one class under one
    parent, in model order, grouped ``k`` to a unit named by its first and last
    (``transformer.h.0-1``), a last group of fewer where ``k`` does not divide them; else
    each root its own. PlanError where ``k`` > 1 would group nothing."""
    named = {r: r for r in roots}
    if k == 1:
        return named
    runs: dict[tuple[str, str], list[str]] = {}
    for fqn, cls in model.modules:
        if fqn in roots and fqn != ROOT:
            runs.setdefault((fqn.rpartition(".")[0], cls), []).append(fqn)
    if all(len(run) == 1 for run in runs.values()):
        units = sorted(roots - {ROOT})
        shown = ", ".join(units[:4]) + (", ..." if len(units) > 4 else "")
        raise PlanError(
            f"units.blocks_per_unit: {k} groups units of one class under one parent, and no "
            f"two units are ({shown or 'the root unit alone'}); name the blocks' class in "
            "units.classes (or units: auto), or drop it"
        )
    for run in runs.values():
        for at in range(0, len(run), k):
            group = run[at : at + k]
            name = group[0] if len(group) == 1 else f"{group[0]}-{group[-1].rpartition('.')[2]}"
            named |= dict.fromkeys(group, name)
    return named



def unit_classes(model: ModelInfo, classes: list[str]) -> list[str]:
    """``classes`` with ``auto`` replaced by the model's repeated block (dropped when it has
    none)."""
    block = repeated_block(model) if AUTO_UNITS in classes else None
    return [block if c == AUTO_UNITS else c for c in classes if c != AUTO_UNITS or block]


def auto_units_note(model: ModelInfo, classes: list[str]) -> str | None:
    """What ``units: auto`` chose, for ``explain()``; None when the plan names its units."""
    if AUTO_UNITS not in classes:
        return None
    block = repeated_block(model)
    if block is None:
        return "units: auto: the model has no repeated block (one unit, unless named ones)"
    return f"units: auto: one per {block}, the model's repeated block"


def repeated_block(model: ModelInfo) -> str | None:
    """The class of the model's repeated blocks (a transformer's layers), the unit a stage-3
    plan wants: of the classes with two or more instances that hold parameters, torch.nn's own
    left out, the one whose instances hold the most elements; None when there is none."""
    under: dict[str, int] = {}  # elements of the parameters under each module
    for p in model.params:
        for module in enclosing(p.fqn.rpartition(".")[0]):
            under[module] = under.get(module, 0) + p.numel
    held: dict[str, int] = {}
    count: dict[str, int] = {}
    for fqn, cls in model.modules:
        if not fqn or hasattr(torch.nn, cls):
            continue
        elements = under.get(fqn, 0)
        if elements:
            held[cls] = held.get(cls, 0) + elements
            count[cls] = count.get(cls, 0) + 1
    repeated = [cls for cls in held if count[cls] >= 2]
    return max(repeated, key=held.__getitem__, default=None)


@register_pass(
    "partition",
    provides=("units",),
    options=lambda plan: {
        "classes": plan.units.classes,
        "modules": plan.units.modules,
        "min_mb": plan.units.min_mb,
        "blocks_per_unit": plan.units.blocks_per_unit,
    },
)
def partition(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    classes: list[str],
    modules: list[str],
    min_mb: float | None,
    blocks_per_unit: int,
) -> fx.GraphModule:
    """Split parameters into FSDP units; tags each parameter placeholder with its unit.

    A training step lays its state out before its first program exists (a checkpoint loads into
    it before the first call), so it hands the units it allocated for in ``ctx.units``: they are
    built once, here or there, never twice. A compile-only run (inspect, estimate) has none."""
    if not ctx.units:
        experts = ctx.expert_parallel.units(ctx.mesh) if ctx.expert_parallel else None
        ctx.units = assign_units(
            ctx.model, ctx.mesh.shard_size, classes, modules, min_mb, experts, blocks_per_unit
        )
    unit_of = {p.fqn: u.name for u in ctx.units for p in u.params}
    for node in placeholders(gm, PARAM):
        tag(node, unit=unit_of[info(node).key])
    return gm
