"""Buckets: several small units' collectives as one, to pay a collective's latency once.

Three kinds are bucketed, each over runs of consecutive collectives of one phase whose units
are each smaller than the bucket size, up to that size in total:

- **Parameter all-gathers** (stage 3): the units' shards are concatenated (copy-in) and gathered
  at once, at the first unit's place; the result holds, rank by rank, every unit's shard, so each
  unit's flat parameter is copied out of its column of the ``(ranks, bucket)`` grid. The bucket
  buffer is freed at once; each unit's copy is freed where the unit's gather was.
- **Gradient reduce-scatters** (stages 1-3): the units' gradients, each viewed as
  ``(ranks, shard)``, are concatenated column-wise, so that every rank's chunk of the bucket is
  its shard of every unit; the reduce-scatter is issued at the last unit's place (when all are
  complete) and each unit reads its slice of the reduced shard.
- **Gradient all-reduces** (stage 0, DDP's buckets): the units' gradients are concatenated,
  all-reduced at the last unit's place, and copied back into each unit's gradient.

Stages 1-2's all-gathers of updated shards are not bucketed, nor hybrid sharding's all-reduces
across replicas.

Both move each element through the same reduction as before (a sum over ranks), only in a
larger message: on two ranks the sums are bit-identical; on more, the collective library may
associate a sum over ranks differently for a different message size.
"""

from __future__ import annotations

import torch
from torch import fx

from zerocc.ir.fake_values import propagate_fake_values
from zerocc.ir.nodes import (
    GATHERED,
    emit,
    emit_collective,
    info,
    op_name,
    tag,
    val,
)
from zerocc.ir.ops import DP_GROUP, op

aten = torch.ops.aten


def _runs(pairs: list[tuple[fx.Node, fx.Node]], bucket_bytes: float) -> list[list]:
    """Runs of consecutive small collectives of one phase, each run up to ``bucket_bytes``."""
    runs: list[list[tuple[fx.Node, fx.Node]]] = []
    current: list[tuple[fx.Node, fx.Node]] = []
    total = 0
    for start, wait in pairs:
        size = info(start).bytes
        same_phase = current and info(current[0][0]).phase == info(start).phase
        if size >= bucket_bytes:
            runs.append(current)
            current, total = [], 0
            continue
        if not same_phase or total + size > bucket_bytes:
            runs.append(current)
            current, total = [], 0
        current.append((start, wait))
        total += size
    runs.append(current)
    return [run for run in runs if len(run) > 1]


def _pairs(gm: fx.GraphModule, name: str) -> list[tuple[fx.Node, fx.Node]]:
    return [
        (n, next(iter(n.users)))
        for n in gm.graph.nodes
        if n.op == "call_function" and op_name(n.target) == f"zerocc.{name}"
    ]


Run = list[tuple[fx.Node, fx.Node]]  # start/wait pairs bucketed together


def _issue(graph: fx.Graph, name: str, args: tuple, run: Run, when: str, phase: str) -> fx.Node:
    """The bucket's collective ``name`` (start and wait, returns the wait), moving the bytes of
    the run's collectives together."""
    units = ", ".join(info(start).unit or "root" for start, _ in run)
    verb = name.removesuffix("_start").replace("_", "-")
    return emit_collective(
        graph,
        op(name),
        op("wait"),
        args,
        nbytes=sum(info(start).bytes for start, _ in run),
        note=f"{verb} bucket {units} {when}",
        phase=phase,
    )


def _erase(graph: fx.Graph, run: Run) -> None:
    for start, wait in run:
        graph.erase_node(wait)
        graph.erase_node(start)


def bucket_gathers(gm: fx.GraphModule, run: list[tuple[fx.Node, fx.Node]]) -> None:
    """One all-gather for the run's units, at the first one's place; each unit copies its
    flat parameter out of the gathered grid."""
    graph = gm.graph
    first = run[0][0]
    shards = [start.args[0] for start, _ in run]
    world = first.args[1]
    sizes = [val(s).numel() for s in shards]
    where = {"phase": info(first).phase}
    with graph.inserting_before(first):
        flat = emit(graph, aten.cat.default, (shards,), note="copy-in of a gather bucket", **where)
        gathered = _issue(
            graph, "all_gather_start", (flat, world, DP_GROUP), run,
            "before the first one's use", info(first).phase,
        )  # fmt: skip
        grid = emit(graph, aten.view.default, (gathered, [world, sum(sizes)]), **where)
        offset = 0
        outs = []
        for (start, _), size in zip(run, sizes, strict=True):
            unit = {"unit": info(start).unit, **where}
            column = emit(graph, aten.slice.Tensor, (grid, 1, offset, offset + size), **unit)
            copied = emit(
                graph,
                aten.clone.default,
                (column,),  # a column of a row-major grid: the clone is contiguous
                role=GATHERED,
                note=f"copy-out of {info(start).unit or 'root'} from its gather bucket",
                **unit,
            )
            outs.append(emit(graph, aten.view.default, (copied, [-1]), **unit))
            offset += size
        emit(graph, op("free"), (gathered,), note="free the gather bucket", **where)
    for (_, wait), out in zip(run, outs, strict=True):
        wait.replace_all_uses_with(out)
    _erase(graph, run)


def _hand_over(wait: fx.Node, value: fx.Node, last: fx.Node, earlier: set[fx.Node]) -> None:
    """``value`` replaces a unit's old wait: it takes the wait's role, and what read the wait
    before the bucket (a unit's accumulation into its gradient shard, hybrid sharding's
    all-reduce across replicas), and what read those before it, now follow it, in order."""
    tag(value, role=info(wait).role, no_grad=info(wait).no_grad)
    wait.replace_all_uses_with(value)
    moved, frontier = [], [value]
    while frontier:
        for user in frontier.pop().users:
            if user in earlier and user not in moved:
                moved.append(user)
                frontier.append(user)
    order = {n: i for i, n in enumerate(_before(value.graph, last))}
    for user in sorted(moved, key=order.__getitem__):
        last.prepend(user)


def bucket_reduce_scatters(gm: fx.GraphModule, run: list[tuple[fx.Node, fx.Node]]) -> None:
    """One reduce-scatter for the run's units, at the last one's place; each unit reads its
    slice of the reduced shard."""
    graph = gm.graph
    last = run[-1][0]
    earlier = set(_before(graph, last))
    world = last.args[1]
    packs = [start.args[0] for start, _ in run]
    shard_sizes = [val(p).numel() // world for p in packs]
    where = {"phase": info(last).phase}
    with graph.inserting_before(last):
        grids = [emit(graph, aten.view.default, (p, [world, -1]), **where) for p in packs]
        grid = emit(graph, aten.cat.default, (grids, 1), note="a gradient bucket", **where)
        flat = emit(graph, aten.view.default, (grid, [-1]), **where)
        reduced = _issue(
            graph, "reduce_scatter_start", (flat, world, DP_GROUP), run,
            "after the last one's gradient", info(last).phase,
        )  # fmt: skip
        offset = 0
        for (start, wait), size in zip(run, shard_sizes, strict=True):
            unit = {"unit": info(start).unit, **where}
            piece = emit(graph, aten.slice.Tensor, (reduced, 0, offset, offset + size), **unit)
            _hand_over(wait, piece, last, earlier)
            offset += size
    _erase(graph, run)


def bucket_all_reduces(gm: fx.GraphModule, run: list[tuple[fx.Node, fx.Node]]) -> None:
    """One all-reduce for the run's units' gradients, at the last one's place; each unit's
    gradient is copied back from the reduced bucket."""
    graph = gm.graph
    last = run[-1][0]
    earlier = set(_before(graph, last))
    grads = [start.args[0] for start, _ in run]
    where = {"phase": info(last).phase}
    with graph.inserting_before(last):
        flat = emit(graph, aten.cat.default, (grads,), note="a gradient bucket", **where)
        reduced = _issue(
            graph, "all_reduce_start", (flat, DP_GROUP), run,
            "after the last one's gradient", info(last).phase,
        )  # fmt: skip
        offset = 0
        for (start, wait), grad in zip(run, grads, strict=True):
            unit = {"unit": info(start).unit, **where}
            size = val(grad).numel()
            piece = emit(graph, aten.slice.Tensor, (reduced, 0, offset, offset + size), **unit)
            back = emit(graph, aten.copy_.default, (grad, piece), **unit)
            _hand_over(wait, back, last, earlier)
            offset += size
    _erase(graph, run)


def _before(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    nodes = list(graph.nodes)
    return nodes[: nodes.index(node)]


def bucket_collectives(gm: fx.GraphModule, bucket_bytes: float) -> None:
    """Bucket runs of small units' parameter all-gathers and gradient reductions."""
    gathers = [
        (s, w)
        for s, w in _pairs(gm, "all_gather_start")
        if info(s).phase in ("forward", "backward")
        and s.args[0].op == "placeholder"
        and s.args[-1] == DP_GROUP
    ]
    for run in _runs(gathers, bucket_bytes):
        bucket_gathers(gm, run)
    # (all-reduces across replicas and tensor parallelism's stay as they are: other groups)
    backward = {
        name: [
            (s, w)
            for s, w in _pairs(gm, name)
            if info(s).phase == "backward" and s.args[-1] == DP_GROUP
        ]
        for name in ("reduce_scatter_start", "all_reduce_start")
    }
    for run in _runs(backward["reduce_scatter_start"], bucket_bytes):
        bucket_reduce_scatters(gm, run)
    for run in _runs(backward["all_reduce_start"], bucket_bytes):
        bucket_all_reduces(gm, run)
    propagate_fake_values(gm)
