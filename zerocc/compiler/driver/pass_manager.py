"""The pass manager: which passes a plan runs, in what order, and a timed, recorded run of them.

A pass's :class:`PassSpec` (:mod:`zerocc.compiler.passes.spec`) says what it requires and
provides (:mod:`zerocc.compiler.capabilities`), when a plan turns it on, whether it changes
numerics, and how its options are read from the plan. The specs are the one source of order:
the default pass list is every pass the plan turns on, ordered by the contracts; a plan's own
``passes`` list is checked against them. Options are bound with ``functools.partial`` when the
pass list is built, so the runner passes nothing pass-specific. Each run is timed and recorded
(:class:`PassRecord`); under ``ZEROCC_VERIFY=1`` the IR invariants and what each pass promised
to provide are checked after it.
"""

from __future__ import annotations

import difflib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

import zerocc.compiler.passes  # noqa: F401  (registers the built-in passes)
from zerocc.compiler import capabilities
from zerocc.compiler.capabilities import CAPTURE_PROVIDES, STEP_NEEDS
from zerocc.compiler.passes.spec import PASSES, PassContext, PassSpec
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.messages import invalid_plan, plan_origin
from zerocc.compiler.state import StateLayout, captured_state
from zerocc.compiler.units import Unit
from zerocc.errors import InvariantError, PassOrderError
from zerocc.ir.fake_values import propagate_fake_values
from zerocc.ir.nodes import count_ops
from zerocc.ir.printing import format_program


@dataclass
class PassRecord:
    """One pass's run: its time, what it changed, and the graph after it when kept."""

    name: str
    seconds: float
    header: str  # "Constructed by pass 'shard' (took 4.1 ms)"
    nodes_before: int
    nodes_after: int
    ops_added: dict[str, int]
    ops_removed: dict[str, int]
    gm: fx.GraphModule | None = None  # a copy of the graph after the pass, when kept
    propagated: int = 0  # nodes whose fake value was computed again after the pass

    @property
    def program(self) -> str:
        """The program after the pass, printed under its header (the header alone when the
        graph was not kept: printing every pass's program cost a twentieth of compile time)."""
        return format_program(self.gm, self.header) if self.gm is not None else f"# {self.header}"


@dataclass(frozen=True)
class PassList:
    """Passes in order, options bound."""

    specs: tuple[PassSpec, ...]
    bound: tuple[Callable[..., fx.GraphModule], ...]


def bind_passes(plan: Plan) -> PassList:
    """Resolve the plan's pass names, check them (`check_passes`), bind each pass's options."""
    # Invariant 4: the default pass list holds no pass that changes numerics unless the plan asks
    # for it (the precision pass runs when the precision section leaves fp32).
    specs = check_passes(plan)
    bound = tuple(functools.partial(s.fn, **s.options(plan)) for s in specs)
    return PassList(specs, bound)


def state_layout(pass_list: PassList, units: list[Unit], plan: Plan) -> StateLayout:
    """The persistent state the programs of a pass list bind for ``units``: what capture binds,
    then each pass's declarations in order, without compiling anything (the runtime allocates
    from it before the first batch; the memory check and estimates count it). A compiled
    program carries the same layout, declared as its passes ran."""
    layout = captured_state(plan)
    for spec in pass_list.specs:
        if spec.declares is not None:
            spec.declares(layout, units, plan)
    return layout


def plan_layout(plan: Plan, units: list[Unit]) -> StateLayout:
    """:func:`state_layout` of ``plan``'s own pass list."""
    return state_layout(bind_passes(plan), units, plan)


def pass_names(plan: Plan) -> list[str]:
    """The passes ``plan`` runs: its ``passes`` list, or the default pass list: every
    registered pass the plan turns on, in the one order their contracts allow."""
    if plan.passes is not None:
        return list(plan.passes)
    return [name for name in _canonical_order() if PASSES[name].enabled_for(plan)]


def check_passes(plan: Plan) -> tuple[PassSpec, ...]:
    """The specs of the plan's pass list, in order, once its names are known, each pass it
    turns on is listed and each listed pass has something to do, and its order is one the
    passes' contracts allow; raises PlanError naming ``passes[i]`` and what is allowed
    (`zerocc plan check` and `zerocc.compile` both call it, before anything is captured)."""
    names = pass_names(plan)
    where = plan_origin(plan.source)
    unknown = [
        f"passes[{i}]: unknown pass {name!r}{_close_match(name)}; known passes: "
        + ", ".join(_canonical_order())
        for i, name in enumerate(names)
        if name not in PASSES
    ]
    if unknown:
        raise invalid_plan(where, unknown)
    first: dict[str, int] = {}
    repeated = []
    for i, name in enumerate(names):
        if name in first:
            repeated.append(
                f"passes[{i}]: {name!r} is listed twice (first at passes[{first[name]}]); each "
                "pass runs once"
            )
        first.setdefault(name, i)
    if repeated:
        raise invalid_plan(where, repeated)
    if plan.passes is not None:
        _check_listed(plan, names, where)
    specs = tuple(PASSES[name] for name in names)
    try:
        check_order(specs)
    except PassOrderError as exc:
        raise PassOrderError(f"{where}: {exc}") from None
    return specs


def _check_listed(plan: Plan, names: list[str], where: str) -> None:
    """A plan's own ``passes`` list holds every pass its sections turn on, and no pass they
    leave with nothing to do (it would run as a silent no-op: the author meant something
    else)."""
    problems = [
        f"passes[{i}]: {name!r} would do nothing: {spec.off_because}; {spec.turn_on}, or drop "
        f"{name!r}"
        for i, name in enumerate(names)
        if not (spec := PASSES[name]).enabled_for(plan)
    ]
    problems += [
        f"{spec.when}, but `passes` does not list {name!r}; add it (passes run in this order: "
        f"{', '.join(_canonical_order())}), or drop `passes` for the default pass list"
        for name, spec in PASSES.items()
        if name not in names
        and not spec.optional
        and spec.enabled is not None
        and spec.enabled(plan)
    ]
    if problems:
        raise invalid_plan(where, problems)


def check_order(specs: list[PassSpec] | tuple[PassSpec, ...]) -> None:
    """Reject a pass list in which a pass runs before what it requires is produced, or after
    what it must precede, or that never produces what a training step needs (STEP_NEEDS). The
    PassOrderError (a PlanError) names ``passes[i]`` and the order the contracts allow."""
    order = f"passes run in this order: {', '.join(_canonical_order())}"
    available = set(CAPTURE_PROVIDES)
    for i, spec in enumerate(specs):
        early = spec.forbids & available
        if early:
            producers = [
                f"{s.name!r} (passes[{j}])" for j, s in enumerate(specs[:i]) if s.provides & early
            ]
            raise PassOrderError(
                f"passes[{i}]: {spec.name!r} must run before {', '.join(producers)}, which "
                f"produces {', '.join(sorted(early))}; {order}"
            )
        missing = spec.requires - available
        if missing:
            raise PassOrderError(
                f"passes[{i}]: {spec.name!r} requires {_produced_by(missing)}, which no earlier "
                f"pass produces; {order}"
            )
        available |= spec.provides
    missing = STEP_NEEDS - available
    if missing:
        raise PassOrderError(
            f"passes: a training step needs {_produced_by(missing)}, which no listed pass "
            f"produces; required passes: {', '.join(_required_passes())}; {order}"
        )


def _produced_by(artifacts: set[str] | frozenset[str]) -> str:
    """Each artifact and the passes that produce it: 'units' (produced by partition); ..."""
    return "; ".join(
        f"{str(a)!r} (produced by {', '.join(s.name for s in PASSES.values() if a in s.provides)})"
        for a in sorted(artifacts)
    )


def _required_passes() -> list[str]:
    """The passes every pass list holds: those producing what a training step needs."""
    return [n for n in _canonical_order() if PASSES[n].provides & STEP_NEEDS]


def _canonical_order() -> list[str]:
    """Every registered pass, in the one order their contracts allow (producers before the
    passes that require what they produce; a pass before the producers of what it forbids),
    ties in registration order."""
    after: dict[str, set[str]] = {name: set() for name in PASSES}  # pass -> passes before it
    for spec in PASSES.values():
        for other in PASSES.values():
            if spec.requires & other.provides:
                after[spec.name].add(other.name)
            if spec.forbids & other.provides:
                after[other.name].add(spec.name)
    order: list[str] = []
    while len(order) < len(after):
        ready = [n for n in after if n not in order and after[n] <= set(order)]
        if not ready:  # a cycle in the contracts: list the rest as registered
            ready = [n for n in after if n not in order]
        order.append(ready[0])
    return order


def _close_match(name: str) -> str:
    close = difflib.get_close_matches(name, list(PASSES), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_provided(spec: PassSpec, gm: fx.GraphModule, ctx: PassContext) -> None:
    """Under ``ZEROCC_VERIFY``: the graph holds what the pass promised to provide."""
    problems = capabilities.missing(spec.provides, gm, ctx)
    if problems:
        raise InvariantError(
            f"pass {spec.name!r} did not provide what it promises: " + "; ".join(problems)
        )


def verify_enabled() -> bool:
    """``ZEROCC_VERIFY=1`` turns on invariant checks after every pass."""
    return os.environ.get("ZEROCC_VERIFY", "0") not in ("", "0", "false", "False")


def run_passes(
    gm: fx.GraphModule,
    ctx: PassContext,
    pass_list: PassList,
    keep: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run each pass in order, timing it, recording the program after it (and ``keep(gm)``, a
    copy of the graph, when given), verifying if asked. Before a pass runs, the state it
    declares is added to ``ctx.layout``."""
    from zerocc.ir.verify import verify_program

    records = []
    verify = verify_enabled()
    propagate_fake_values(gm)  # records what each captured value was computed from
    ctx.layout = captured_state(ctx.plan)
    for spec, fn in zip(pass_list.specs, pass_list.bound, strict=True):
        before = count_ops(gm.graph.nodes)
        n_before = len(gm.graph.nodes)
        start = time.perf_counter()
        if spec.declares is not None:
            spec.declares(ctx.layout, ctx.units, ctx.plan)
        gm = fn(gm, ctx)
        propagated = propagate_fake_values(gm)  # what the pass changed, what depends on it
        seconds = time.perf_counter() - start
        if verify:
            verify_program(gm, after=spec.name)
            _check_provided(spec, gm, ctx)
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
                header,
                n_before,
                len(gm.graph.nodes),
                added,
                removed,
                keep(gm) if keep else None,
                propagated,
            )
        )
    gm.recompile()  # passes leave the code to the pass manager: generated where read or run
    return gm, records
