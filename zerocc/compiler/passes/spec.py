"""What a pass is: its registered spec (the contract the pass manager checks) and the context
every pass reads.

A pass is ``fn(gm, ctx, **options) -> gm``, registered with :func:`register_pass`: what it
requires and provides (:mod:`zerocc.compiler.capabilities`), when a plan runs it, whether it
changes numerics, and how its options are read from the plan. The passes
(:mod:`zerocc.compiler.passes`) import this module; the pass manager
(:mod:`zerocc.compiler.driver.pass_manager`) imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from zerocc.compiler.capabilities import Capability, capability
from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.parallel.experts import ExpertParallel
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.tensor_parallel import TensorParallel
from zerocc.compiler.plan import Plan
from zerocc.compiler.state import StateLayout
from zerocc.compiler.units import Unit

Declares = Callable[[StateLayout, list[Unit], Plan], None]


@dataclass(frozen=True)
class PassSpec:
    """A registered pass and its contract."""

    name: str
    fn: Callable[..., fx.GraphModule]
    requires: frozenset[Capability]
    provides: frozenset[Capability]
    forbids: frozenset[Capability]  # the pass runs before whatever provides these
    changes_numerics: bool
    options: Callable[[Plan], dict[str, Any]]
    doc: str
    # When the default pass list holds the pass, and how a plan turns it on (said when a plan
    # lists the pass with nothing to do); None: every plan runs it.
    enabled: Callable[[Plan], bool] | None = None
    when: str = ""  # "the precision section leaves fp32"
    off_because: str = ""  # "the precision section keeps fp32 everywhere"
    turn_on: str = ""  # "set precision.param: bf16 (or fp16)"
    # A plan's own `passes` may leave it out though its section turns it on: it changes the
    # schedule, not what is computed (overlap).
    optional: bool = False
    # The persistent state the pass creates or changes, declared into the layout before it runs
    # (and, without a graph, when the runtime lays out the state): ``declares(layout, units,
    # plan)``. The pass makes its state placeholders from the layout.
    declares: Declares | None = None

    def enabled_for(self, plan: Plan) -> bool:
        """Whether ``plan``'s default pass list runs this pass."""
        return self.enabled is None or self.enabled(plan)


PASSES: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    *,
    requires: tuple[str, ...] = (),
    provides: tuple[str, ...] = (),
    forbids: tuple[str, ...] = (),
    changes_numerics: bool = False,
    options: Callable[[Plan], dict[str, Any]] | None = None,
    enabled: Callable[[Plan], bool] | None = None,
    when: str = "",
    off_because: str = "",
    turn_on: str = "",
    optional: bool = False,
    declares: Declares | None = None,
) -> Callable[[Callable[..., fx.GraphModule]], Callable[..., fx.GraphModule]]:
    """Register ``fn`` as pass ``name``; ``options(plan)`` gives its keyword options.

    ``requires`` must be provided by an earlier pass; ``forbids`` must not be (the pass has to
    run before whatever provides it); names are :class:`Capability` values (an unknown one is
    an error here). ``enabled(plan)``: whether the default pass list runs it (every plan, when
    None), ``when`` saying so in words, ``off_because`` and ``turn_on`` what a plan that lists
    it with nothing to do is told; ``optional``: a plan's own ``passes`` may leave it out;
    ``declares``: the state it creates or changes (see :class:`PassSpec`)."""

    def decorate(fn: Callable[..., fx.GraphModule]) -> Callable[..., fx.GraphModule]:
        PASSES[name] = PassSpec(
            name,
            fn,
            frozenset(capability(c) for c in requires),
            frozenset(capability(c) for c in provides),
            frozenset(capability(c) for c in forbids),
            changes_numerics,
            options or (lambda plan: {}),
            (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
            enabled,
            when,
            off_because,
            turn_on,
            optional,
            declares,
        )
        return fn

    return decorate


@dataclass
class PassContext:
    """What every pass may read (and analysis passes may fill): the run's fixed facts."""

    plan: Plan
    # The ranks' layout, the session's (computed once, from the plan and the world size): the
    # groups units are sharded over, replicated across, split by and reduced over.
    mesh: Mesh
    model: ModelInfo
    boundary: bool = True  # whether this program ends with the optimizer step
    units: list[Unit] = field(default_factory=list)  # filled by the partition pass
    # The state the passes so far declared (each pass's ``declares``, run before it).
    layout: StateLayout = field(default_factory=StateLayout)
    # The layers the plan splits over the tp ranks (``model`` gives their slices' shapes).
    tensor_parallel: TensorParallel | None = None
    # The experts modules the plan splits over the ep ranks (``model`` gives their slices).
    expert_parallel: ExpertParallel | None = None
    # A pipeline rank's update, after its stages' backward programs accumulated the gradients
    # of these parameters (FQNs): a program with no forward or backward of its own, which
    # reduces the accumulated gradients and updates. None: any other program.
    update_of: frozenset[str] | None = None
    # Units a pipeline rank holds that another pipeline rank holds too (an embedding tied to
    # the output head): their accumulated gradients are summed over the ``tie`` group before
    # the update; ``tied_norm``: this rank counts them in the clipping norm (one rank does).
    tied: frozenset[str] = frozenset()
    tied_norm: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):  # (a world size where the mesh goes: a caller's slip)
            raise TypeError(f"PassContext.mesh: a Mesh (the session's), not {self.mesh!r}")

    @property
    def world_size(self) -> int:
        """The ranks the program is compiled for (the mesh's)."""
        return self.mesh.world_size
