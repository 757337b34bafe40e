"""What a pass is: its registered spec (the contract the pass manager checks) and the context
every pass reads.

A pass is ``fn(gm, ctx, **options) -> gm``, registered with :func:`register_pass`: what it
requires and produces (artifact names such as ``"units"``), whether it changes numerics, and how
its options are read from the plan. The passes (:mod:`zerocc.passes`) import this module; the
pass manager (:mod:`zerocc.compiler.pass_manager`) imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.plan import Plan
from zerocc.compiler.units import Unit


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
