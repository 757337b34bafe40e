"""Passes: registration with a contract, order checking, and a timed, recorded pipeline run.

A pass is ``fn(gm, ctx, **options) -> gm``. Its :class:`PassSpec` says what it requires and
produces (artifact names such as ``"units"``), whether it changes numerics, and how its options
are read from the plan; they are bound with ``functools.partial`` when the pipeline is built, so
the runner passes nothing pass-specific. Each run is timed; the graph after every pass is kept as
a :class:`PassRecord` (printed program and op counts) for inspection, and the IR invariants are
verified after each pass when ``ZEROCC_VERIFY=1``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from zerocc.capture import ModelInfo
from zerocc.errors import PassOrderError, PlanError
from zerocc.ir import count_ops, propagate_fake_values
from zerocc.plan import Plan
from zerocc.units import Unit

CAPTURE_PROVIDES = frozenset({"joint_graph"})


@dataclass(frozen=True)
class PassSpec:
    """A registered pass and its contract."""

    name: str
    fn: Callable[..., fx.GraphModule]
    requires: frozenset[str]
    produces: frozenset[str]
    forbids: frozenset[str]
    changes_numerics: bool
    options: Callable[[Plan], dict[str, Any]]
    doc: str


PASSES: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    *,
    requires: tuple[str, ...] = (),
    produces: tuple[str, ...] = (),
    forbids: tuple[str, ...] = (),
    changes_numerics: bool = False,
    options: Callable[[Plan], dict[str, Any]] | None = None,
) -> Callable[[Callable[..., fx.GraphModule]], Callable[..., fx.GraphModule]]:
    """Register ``fn`` as pass ``name``; ``options(plan)`` gives its keyword options.

    ``requires`` must be produced by an earlier pass; ``forbids`` must not be (the pass has to
    run before whatever produces it)."""

    def decorate(fn: Callable[..., fx.GraphModule]) -> Callable[..., fx.GraphModule]:
        PASSES[name] = PassSpec(
            name,
            fn,
            frozenset(requires),
            frozenset(produces),
            frozenset(forbids),
            changes_numerics,
            options or (lambda plan: {}),
            (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
        )
        return fn

    return decorate


@dataclass
class PassContext:
    """What every pass may read (and analysis passes may fill): the run's fixed facts."""

    plan: Plan
    world_size: int
    model: ModelInfo
    boundary: bool = True  # whether this program ends with the optimizer step
    units: list[Unit] = field(default_factory=list)  # filled by the partition pass


@dataclass
class PassRecord:
    """One pass's run: its time, the graph after it, and what it changed."""

    name: str
    seconds: float
    program: str
    nodes_before: int
    nodes_after: int
    ops_added: dict[str, int]
    ops_removed: dict[str, int]
    gm: fx.GraphModule | None = None  # a copy of the graph after the pass, when kept


@dataclass(frozen=True)
class Pipeline:
    """Passes in order, options bound."""

    specs: tuple[PassSpec, ...]
    bound: tuple[Callable[..., fx.GraphModule], ...]


def build_pipeline(plan: Plan) -> Pipeline:
    """Resolve the plan's pass names, check the order, bind each pass's options."""
    import zerocc.passes  # noqa: F401  (registers the built-in passes)

    # Invariant 4: the default pipeline holds no pass that changes numerics unless the plan asks
    # for it (the precision pass runs when the precision section leaves fp32).
    names = plan.pass_names
    specs = []
    for i, name in enumerate(names):
        if name not in PASSES:
            raise PlanError(
                f"passes[{i}]: unknown pass {name!r}; known passes: " + ", ".join(sorted(PASSES))
            )
        specs.append(PASSES[name])
    check_order(specs)
    bound = tuple(functools.partial(s.fn, **s.options(plan)) for s in specs)
    return Pipeline(tuple(specs), bound)


def check_order(specs: list[PassSpec] | tuple[PassSpec, ...]) -> None:
    """Reject a pipeline in which a pass runs before what it requires is produced, or after
    what it must precede."""
    available = set(CAPTURE_PROVIDES)
    for spec in specs:
        early = spec.forbids & available
        if early:
            producers = [s.name for s in specs if s.produces & early]
            raise PassOrderError(
                f"pass {spec.name!r} must run before {', '.join(map(repr, producers))} "
                f"(which produces {', '.join(sorted(early))})"
            )
        missing = spec.requires - available
        if missing:
            providers = {m: [s.name for s in PASSES.values() if m in s.produces] for m in missing}
            needs = "; ".join(
                f"{m!r} (produced by {', '.join(p) or 'no registered pass'})"
                for m, p in sorted(providers.items())
            )
            raise PassOrderError(
                f"pass {spec.name!r} requires {needs}, which no earlier pass "
                "in the pipeline produces"
            )
        available |= spec.produces


def verify_enabled() -> bool:
    """``ZEROCC_VERIFY=1`` turns on invariant checks after every pass."""
    return os.environ.get("ZEROCC_VERIFY", "0") not in ("", "0", "false", "False")


def run_pipeline(
    gm: fx.GraphModule,
    ctx: PassContext,
    pipeline: Pipeline,
    keep: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run each pass in order, timing it, recording the program after it (and ``keep(gm)``, a
    copy of the graph, when given), verifying if asked."""
    from zerocc.printing import format_program
    from zerocc.verify import verify_program

    records = []
    verify = verify_enabled()
    for spec, fn in zip(pipeline.specs, pipeline.bound, strict=True):
        before = count_ops(gm.graph.nodes)
        n_before = len(gm.graph.nodes)
        start = time.perf_counter()
        gm = fn(gm, ctx)
        if count_ops(gm.graph.nodes) != before or len(gm.graph.nodes) != n_before:
            propagate_fake_values(gm)
        seconds = time.perf_counter() - start
        if verify:
            verify_program(gm, after=spec.name)
        after = count_ops(gm.graph.nodes)
        added = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in after
            if after.get(k, 0) > before.get(k, 0)
        }
        removed = {k: before[k] - after.get(k, 0) for k in before if before[k] > after.get(k, 0)}
        header = f"Constructed by pass {spec.name!r} (took {seconds * 1e3:.1f} ms)"
        records.append(
            PassRecord(
                spec.name,
                seconds,
                format_program(gm, header),
                n_before,
                len(gm.graph.nodes),
                added,
                removed,
                keep(gm) if keep else None,
            )
        )
    return gm, records
