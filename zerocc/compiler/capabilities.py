"""What passes provide and require: one name per capability, what it means in the graph, and
the check ``ZEROCC_VERIFY=1`` runs after a pass that promised it.

A pass spec (:mod:`zerocc.compiler.passes.spec`) lists the capabilities it requires (some earlier
pass, or capture, provided them), provides, and forbids (it must run before whatever provides
them). The pass manager orders the default pass list by these contracts and checks a plan's own
``passes`` list against them.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

import torch
from torch import fx

from zerocc.compiler.plan import Plan
from zerocc.compiler.state import placements
from zerocc.compiler.units import Unit
from zerocc.ir.nodes import (
    GRAD_SHARD,
    PARAM,
    PARAM_FULL,
    PARAM_SHARD,
    info,
    nodes_with_role,
    op_name,
    placeholders,
)
from zerocc.ir.ops import UPDATE_OPS


class PassContext(Protocol):
    """What a check reads of the compile (a :class:`zerocc.compiler.passes.spec.PassContext`)."""

    plan: Plan
    units: list[Unit]
    boundary: bool


class Capability(StrEnum):
    """What the graph holds once a pass (or capture) provided it."""

    JOINT_GRAPH = "joint_graph"  # forward and backward of the loss, one placeholder per param
    UNITS = "units"  # every parameter placeholder tagged with its FSDP unit
    SHARDED_PARAMS = "sharded_params"  # parameters read from flat (sharded) unit state
    GRAD_SHARDS = "grad_shards"  # each trainable unit's reduced gradient, for its update
    MIXED_PRECISION = "mixed_precision"  # compute in the plan's low-precision dtype
    OPTIMIZER_UPDATE = "optimizer_update"  # each trainable unit updated (in a stepping program)
    RECOMPUTE = "recompute"  # chosen units' forward recomputed before their backward
    OVERLAPPED = "overlapped"  # collectives scheduled to overlap compute
    OFFLOADED = "offloaded"  # offloaded states moved by copies around their uses


CAPTURE_PROVIDES = frozenset({Capability.JOINT_GRAPH})
# What a compiled training step needs its passes to provide: units (its state is laid out
# per unit), gradients reduced into shards, and the optimizer's update. Without the update a
# step would run forward and backward and never change a weight.
STEP_NEEDS = frozenset({Capability.UNITS, Capability.GRAD_SHARDS, Capability.OPTIMIZER_UPDATE})


def capability(name: str) -> Capability:
    """``name`` as a Capability; a ValueError listing the known ones for any other."""
    try:
        return Capability(name)
    except ValueError:
        known = ", ".join(c.value for c in Capability)
        raise ValueError(f"unknown capability {name!r}; known: {known}") from None


# -- the checks -------------------------------------------------------------------------------
# Each returns what is missing (None when the graph provides the capability).

Check = Callable[[fx.GraphModule, PassContext], str | None]


def _units(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    if not ctx.units:
        return "no units were assigned"
    untagged = [n.name for n in placeholders(gm, PARAM) if info(n).unit is None]
    return f"parameters without a unit: {', '.join(untagged[:5])}" if untagged else None


def _sharded_params(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    left = [n.name for n in placeholders(gm, PARAM)]
    if left:
        return f"parameters still read whole: {', '.join(left[:5])}"
    flat = placeholders(gm, PARAM_FULL) + placeholders(gm, PARAM_SHARD)
    return None if flat else "no flat parameter placeholder"


def _trainable(ctx: PassContext) -> set[str]:
    return {u.name for u in ctx.units if u.trainable}


def _grad_shards(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    if not ctx.boundary:
        return None  # an accumulating program keeps its gradients for the stepping one
    reduced = {info(n).unit for n in nodes_with_role(gm, GRAD_SHARD)}
    missing = sorted(_trainable(ctx) - reduced)
    return f"units without a reduced gradient: {', '.join(missing)}" if missing else None


def _optimizer_update(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    if not ctx.boundary:
        return None  # an accumulating program updates nothing
    updated = {info(n).unit for n in _ops(gm, *(f"zerocc.{name}" for name in UPDATE_OPS))}
    missing = sorted(_trainable(ctx) - updated)
    return f"units without an update: {', '.join(missing)}" if missing else None


def _mixed_precision(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    compute = ctx.plan.precision.dtype("param")
    flat = placeholders(gm, PARAM_FULL) + placeholders(gm, PARAM_SHARD)
    if any(n.meta["val"].dtype == compute for n in flat):
        return None
    return f"no flat parameter is kept in the compute dtype {compute}"


def _recompute(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    # A chosen unit that saves nothing for backward is left as it is: nothing to recompute.
    # What is recomputed runs in backward, right before the backward that reads it.
    early = [
        n.name
        for n in gm.graph.nodes
        if (info(n).note or "").startswith("recomputed") and info(n).phase != "backward"
    ]
    return f"recomputed outside backward: {', '.join(early[:5])}" if early else None


def _overlapped(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    starts = [n for n in gm.graph.nodes if op_name(n.target).endswith("_start")]
    waits = _ops(gm, "zerocc.wait")
    if len(starts) != len(waits):
        return f"{len(starts)} collectives or copies started, {len(waits)} waited on"
    return None


def _offloaded(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    if not any(p.offloaded for p in placements(ctx.units, ctx.plan.offload).values()):
        return None  # the plan's ratio offloads no unit of this model
    offload = ctx.plan.offload
    reads_nvme = offload.params == "nvme" or (offload.optimizer == "nvme" and ctx.boundary)
    if reads_nvme and not _ops(gm, "zerocc.nvme_read_start"):
        return "states placed on NVMe, but nothing reads them"
    values = (n.meta.get("val") for n in placeholders(gm))
    on_gpu = any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)
    copies = _ops(gm, "zerocc.copy_start", "zerocc.copy_into_start")
    if on_gpu and not copies:  # (on a CPU-only machine host and device are one memory)
        return "offloaded units, but no copy moves their states"
    return None


def _ops(gm: fx.GraphModule, *names: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in names]


CHECKS: dict[Capability, Check] = {
    Capability.JOINT_GRAPH: lambda gm, ctx: None if placeholders(gm) else "no placeholder",
    Capability.UNITS: _units,
    Capability.SHARDED_PARAMS: _sharded_params,
    Capability.GRAD_SHARDS: _grad_shards,
    Capability.MIXED_PRECISION: _mixed_precision,
    Capability.OPTIMIZER_UPDATE: _optimizer_update,
    Capability.RECOMPUTE: _recompute,
    Capability.OVERLAPPED: _overlapped,
    Capability.OFFLOADED: _offloaded,
}


def missing(provided: frozenset[Capability], gm: fx.GraphModule, ctx: PassContext) -> list[str]:
    """What of ``provided`` the graph does not hold: 'capability: why', one per line."""
    problems = ((c, CHECKS[c](gm, ctx)) for c in sorted(provided))
    return [f"{c.value}: {why}" for c, why in problems if why is not None]
