"""The whole program as one Inductor graph: compute fused across units, zerocc's ops in place.

:func:`rewrite` turns a scheduled program into a graph Inductor accepts whole: every zerocc op
becomes its twin of :mod:`zerocc.backends.inductor.lowered_ops` (a start names its node, a wait
its start; a start that filled a tensor returns nothing, and what read its result reads that
tensor), and the frees go (Inductor frees each buffer after its last read). :func:`compile_whole`
compiles it with the options that keep the passes' schedule: Inductor's reordering for peak
memory and for locality moved every gather of a ZeRO-3 step to its start (all parameters
gathered at once), and so did its reordering for compute/communication overlap (off by
default; said off here so that a release turning it on changes nothing), so all three are
off, and the kernels run in the program's order, fused.

Random ops and the generator-state ops of recomputation's replay are chained by a token
(:mod:`zerocc.backends.inductor.random_ops`), so they draw in the program's order, as eager
does. Programs it does not take (:func:`unsupported`): one that reads and writes NVMe, frees an
input, draws with an op a ``draw`` cannot describe, or calls an op Inductor lowers wrongly
(:mod:`zerocc.backends.inductor.unlowerable`); those are compiled region by region.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from zerocc.backends.eager.executable import zerocc_op
from zerocc.backends.inductor.lowered_ops import (
    DROPPED,
    FILLING_STARTS,
    LOWERED,
    lowered,
    register_lowerings,
)
from zerocc.backends.inductor.random_ops import thread_generator
from zerocc.backends.inductor.random_ops import unsupported as undrawable
from zerocc.backends.inductor.unlowerable import unlowerable
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import info

# Filling starts that read a source tensor (their second argument) while in flight.
SOURCED = frozenset({"all_gather_into_start", "copy_into_start"})

# zerocc's generator-state ops, which the token chain takes.
GENERATOR = frozenset({"rng_state", "set_rng_state", "seed_draw"})

# Inductor options for the whole graph: the program's order kept (see the module's docstring).
KEEP_ORDER = {
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "reorder_for_compute_comm_overlap": False,
}


def unsupported(program: fx.GraphModule) -> str | None:
    """Why ``program`` cannot be lowered whole (None when it can)."""
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if (why := unlowerable(node)) is not None:
            return f"it calls {why}"
        name = zerocc_op(node)
        if name is not None and name not in LOWERED | DROPPED | GENERATOR:
            return f"it holds zerocc.{name}"
        if name in DROPPED and node.args[0].op == "placeholder":
            # Inductor frees what the program made, never what it was given.
            return f"it frees its input {node.args[0].name}"
    return undrawable(program.graph)


def rewrite(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``program`` whose zerocc ops are their lowered twins, without frees, and
    whose random and generator-state ops are chained twins."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    thread_generator(graph)
    # The wait's start, and what the start reads that must outlive it (a filling start's
    # source), before any start is rewritten (a filling start's uses move to what it fills).
    started = {n: n.args[0] for n in graph.nodes if zerocc_op(n) == "wait"}
    reads = {s: list(s.args[1:2]) if zerocc_op(s) in SOURCED else [] for s in started.values()}
    by_name = {n.name: n for n in graph.nodes}
    became: dict[fx.Node, fx.Node] = {}  # a rewritten wait -> what its readers read now
    for node in list(graph.nodes):
        name = zerocc_op(node)
        if name is None:
            continue
        if name in DROPPED:
            graph.erase_node(node)
        elif name == "wait":
            start = started[node]
            kept = [became.get(r, r) for r in reads[start]]
            node.target, node.args = lowered(name), (node.args[0], kept, start.name)
            became[node] = node.args[0]
            node.replace_all_uses_with(node.args[0])
        elif name == "host_wait":  # what the update reads stays, unchanged, until it is done
            tensor, update = node.args
            read = [a for a in by_name[update].args if isinstance(a, fx.Node) and a is not tensor]
            node.target, node.args = lowered(name), (tensor, read, update)
            became[node] = tensor
            node.replace_all_uses_with(tensor)
        elif info(node).stream == Stream.HOST:  # an update issued to the host's worker
            node.target, node.args = lowered(f"host_{name}"), (*node.args, node.name)
        elif name in FILLING_STARTS:
            filled = node.args[0]
            with graph.inserting_before(node):
                twin = graph.call_function(lowered(name), (*node.args, node.name), node.kwargs)
            twin.meta = dict(node.meta)
            node.replace_all_uses_with(filled)
            graph.erase_node(node)
        elif name.endswith("_start"):
            node.target, node.args = lowered(name), (*node.args, node.name)
        else:
            node.target = lowered(name)
    return fx.GraphModule(program, graph)


def compile_whole(program: fx.GraphModule, example_inputs: list[Any], options: dict) -> Any:
    """``program`` rewritten and compiled by Inductor as one graph (``options``: Inductor
    config on top of :data:`KEEP_ORDER`); called with the program's inputs, it returns what
    the program returns, the twins running the implementations made current by
    :func:`~zerocc.backends.inductor.lowered_ops.running`."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    register_lowerings()
    with config.patch({**options, **KEEP_ORDER}):
        return compile_fx(rewrite(program), example_inputs)
