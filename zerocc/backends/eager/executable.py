"""The eager executable: a program bound to one runtime context, run as fx's generated Python.

Binding copies the program's graph and points every zerocc op node at the implementation of
this executable's :class:`~zerocc.backends.eager.ops.EagerOps`: a start op (and an update on
the host stream) is told its node's name, and a ``wait`` the name of the start it completes,
so handles in flight are keyed by node, never by a tensor's address. The generated code drops
each intermediate after its last use, as the program's own would. Nodes keep the program's
names and ``meta``, so interpreting :attr:`EagerExecutable.gm` node by node (profiling,
calibration) reads as the program does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from zerocc.backends.eager.ops import EagerOps
from zerocc.backends.kernels import newton_schulz  # noqa: F401 (registers Muon's ops)
from zerocc.engine import RuntimeContext
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import info
from zerocc.ir.ops import COLLECTIVE_STARTS, TRANSFER_STARTS
from zerocc.ir.owned_update_ops import OWNED_UPDATE_OPS

STARTS = frozenset((*COLLECTIVE_STARTS, *TRANSFER_STARTS))
# zerocc ops whose implementation is registered with their schema: the RNG ops read and set the
# process's generator (zerocc.ir.rng, zerocc.ir.keyed_draws); a pipeline stage's transfers act
# on the pipeline rank running the action (zerocc.runtime.pipeline).
# Muon's owned update (zerocc.backends.kernels.newton_schulz, registered on import) too.
IMPLEMENTED_WITH_SCHEMA = frozenset(
    {"rng_state", "set_rng_state", "seed_draw", "send", "recv", "keep", "kept", *OWNED_UPDATE_OPS}
)


class EagerExecutable:
    """A program bound to a runtime context; call it with the program's placeholders."""

    def __init__(self, program: fx.GraphModule, ctx: RuntimeContext) -> None:
        self.ops = EagerOps(ctx)
        self.gm = bind(program, self.ops)

    def __call__(self, *args: Any) -> Any:
        return self.gm(*args)

    def in_flight(self) -> int:
        """Collectives and copies issued and not yet waited on (0 after every complete run)."""
        return len(self.ops.in_flight)

    def reset(self) -> None:
        """Drop the handles a failed run left in flight and the rows its exchanges kept, so the
        next run starts clean (host updates still running are waited out first: they write
        the states)."""
        self.ops.ctx.host.settle()
        self.ops.in_flight.clear()
        self.ops.ctx.payloads.clear()

    def lowering(self) -> str:
        """Every op as written."""
        return "eager"

    def notes(self) -> list[str]:
        """Nothing to add: every op runs as written."""
        return []

    def artifacts(self) -> dict[str, str]:
        """Nothing generated."""
        return {}


def bind(program: fx.GraphModule, ops: EagerOps) -> fx.GraphModule:
    """A copy of ``program`` whose zerocc op nodes call ``ops``' implementations."""
    graph = fx.Graph()
    graph._codegen = program.graph._codegen
    graph.output(graph.graph_copy(program.graph, {}))
    ops_of = {node: zerocc_op(node) for node in graph.nodes}  # before any node is rebound
    # The graph module and its graph reference each other: only the cycle collector frees
    # them. Held strongly, the ops (and the comm of their context) would live as long, and a
    # dropped step would keep its process group past the default group's destruction.
    ops_ref = weakref.ref(ops)
    for node, name in ops_of.items():
        if name is None or name in IMPLEMENTED_WITH_SCHEMA:
            continue
        if getattr(ops, name, None) is None:
            raise NotImplementedError(f"the eager backend has no implementation of zerocc.{name}")
        host_update = info(node).stream == Stream.HOST and name != "host_wait"
        if name in STARTS or host_update:  # (a host update is issued to the host's worker)
            node.kwargs = {**node.kwargs, "started": node.name}
        elif name == "wait":
            start = node.args[0]
            if not isinstance(start, fx.Node) or ops_of.get(start) not in STARTS:
                raise ValueError(f"{node.name}: zerocc.wait of {start}, no collective or copy")
            node.kwargs = {**node.kwargs, "started": start.name}
        node.target = _standing_in_for(node.target, ops_ref, name)
    return fx.GraphModule(program, graph)


def zerocc_op(node: fx.Node) -> str | None:
    """The name of the zerocc op ``node`` calls (``wait``, ...), None for any other node."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema.name.split("::")[-1] if target.namespace == "zerocc" else None


def _standing_in_for(
    op: torch._ops.OpOverload, ops: weakref.ref[EagerOps], name: str
) -> Callable[..., Any]:
    """A plain function named after ``op`` (fx's generated code calls it by that name) that
    runs ``name`` of the executable's ops, with ``__wrapped__`` = ``op`` so readers of the
    graph still see the op."""

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ops()
        if bound is None:
            raise RuntimeError(f"zerocc.{name}: the executable of this program was released")
        return getattr(bound, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__wrapped__ = op
    return call
