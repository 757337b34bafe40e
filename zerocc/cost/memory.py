"""Memory of a rank, predicted from a scheduled program without running it.

Two parts. **Model states** are the persistent tensors of the plan (``zerocc/compiler/state.py``):
the runtime allocates exactly these, so their bytes are exact. **Transient memory** follows the
program's liveness: a node's result occupies its storage from the node until the last use of
anything that aliases that storage (views, ``wait``), as the eager backend's generated code
drops references; a collective (or a copy) holds its inputs until its wait (its work handle
keeps them); ``zerocc.free`` releases a gathered unit at once. In-place ops and views allocate
nothing. Storages made by an all-gather count as *gathered*; every other transient (activations
saved for backward, gradients, packed buckets) as *activations*: without gradient accumulation
no gradient is model state, and the reduced gradients the update reads are transients from
their reduction to the update. The rows expert parallelism's exchanges receive, which the
runtime keeps outside the program's values, count as activations from the op that puts them to
the one that takes them, at a uniform routing's share. What offload keeps in host memory or on
NVMe (states, and the host buffers of its copies) is not device memory: it is reported apart
(model states ``host``, ``nvme``; the host buffers' peak).

**Collective buffers** (``comm``) are what the process group allocates itself. On a CPU the
collectives run on gloo (torch 2.13), which moves an all-gather, a reduce-scatter or an
all-to-all through a flat tensor of its own, the whole size the collective moves (an
all-reduce works in place): a reduce-scatter's (and an all-to-all's) from when it is issued,
an all-gather's while one of the group's two worker threads runs it. The prediction holds the
first from its start to its wait and counts the largest two all-gathers in flight on each
group: an upper bound, since gloo drops a buffer as soon as its collective is done. Measured
on 2 gloo ranks, what a step allocated (gloo's thread included) against this bound: the
tests' tiny GPT 0.3% over it at stage 3 (the few hundred bytes of scalars made outside the
program, 0.6% at stage 0; 19% over the program's values alone), 15% under it at stage 2; the
example GPT at 31.6M 4-6% under it at stages 1-3 (2-6% over the values alone). A bound,
because the memory check must not pass a step that does not fit. NCCL's buffers are its own,
not tensors: on a GPU the category is empty.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import fx

from zerocc.compiler.parallel.experts import payloads
from zerocc.compiler.state import DEVICE, HOST, NVME, StateLayout
from zerocc.cost.timeline import MemoryTimeline
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import (
    GATHERED,
    GRAD,
    LOSS_SCALE,
    LR,
    MASTER,
    OPTIM_STATE,
    PARAM_FULL,
    PARAM_SHARD,
    STEP,
    info,
    op_kind,
    op_name,
    val,
)
from zerocc.ir.ops import ALL_REDUCE, PARAM_GATHERS, TO_HOST, UNIT_GROUPS

# As ZeRO counts them: fp32 master weights are optimizer state (2 + 2 + 12 bytes per parameter).
STATE_CATEGORY = {
    PARAM_FULL: "params",
    PARAM_SHARD: "params",
    GRAD: "grads",
    MASTER: "optimizer",
    OPTIM_STATE: "optimizer",
    STEP: "optimizer",
    LR: "optimizer",
    LOSS_SCALE: "optimizer",
}


def model_state_bytes_of(layout: StateLayout) -> dict[str, int]:
    """Bytes of a state layout on the device per category (params, grads,
    optimizer, total), and of what offload places elsewhere (``host``, ``nvme``: totals).
    Views (stages 1-2 ``param_shard``) are not counted twice."""
    out: dict[str, int] = defaultdict(int)
    for spec in layout:
        if spec.is_view:
            continue
        if spec.location == DEVICE:
            out[STATE_CATEGORY[spec.role]] += spec.nbytes
        else:
            out[spec.location] += spec.nbytes
    out["total"] = sum(out[c] for c in ("params", "grads", "optimizer"))
    return dict(out)


def snapshot_bytes_of(states: dict[str, int]) -> int:
    """Bytes of every state :func:`model_state_bytes_of` counted (``states``), on the device,
    in host memory and on NVMe: what an in-memory snapshot of the rank holds
    (``checkpoint.in_memory``; its header and RNG states aside)."""
    return states["total"] + states.get(HOST, 0) + states.get(NVME, 0)


def node_label(node: fx.Node) -> str:
    """How a timeline point names the node that ran: its op and unit."""
    return op_name(node.target) + (f" {info(node).unit}" if info(node).unit else "")


def transient_category(node: fx.Node) -> str:
    """Where a storage a node makes is counted: an all-gather of a unit's shards (on ``dp``),
    or a unit's copy out of a gather bucket, is a gathered unit; tensor parallelism's gathers
    (of activations, on ``tp``) are activations."""
    unit_gather = op_name(node.target) in PARAM_GATHERS and node.args[-1] in UNIT_GROUPS
    return "gathered" if unit_gather or info(node).role == GATHERED else "activations"


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's value (a tensor, or a tuple/list of values)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def storage_id(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views of one storage share it)."""
    return t.untyped_storage()._cdata


def _done(user: fx.Node) -> fx.Node:
    """Where a use by ``user`` ends: a collective or a copy reads its inputs until its wait."""
    if info(user).stream != Stream.COMPUTE and info(user).bytes and len(user.users) == 1:
        return next(iter(user.users))
    return user


def _held_for_the_run(node: fx.Node) -> bool:
    """A copy's host result, or a host buffer: the same buffer every step, held from the
    first step on (:class:`zerocc.engine.host_memory.HostBuffers`)."""
    name = op_name(node.target)
    return name == "zerocc.host_buffer" or (name == "zerocc.copy_start" and node.args[2] == TO_HOST)


# Worker threads of a gloo process group: torch gives it two per network device (one here).
GLOO_THREADS = 2
_GATHERS = (*PARAM_GATHERS, "zerocc.all_gather_into_start")


def _gloo_buffer_bytes(node: fx.Node) -> int:
    """Bytes gloo allocates while the collective that ``node`` starts runs: what it moves (its
    all-gathered, reduce-scattered or exchanged whole; an all-reduce's none, it works in
    place); 0 for any other node."""
    if op_kind(node) is not OpKind.COLLECTIVE or op_name(node.target) == ALL_REDUCE:
        return 0
    return info(node).bytes


def predict_memory(
    gm: fx.GraphModule, model_states: dict[str, int], *, gloo: bool = False
) -> MemoryTimeline:
    """Live bytes per category after each node of ``gm``: the model states throughout, plus
    gathered units and activations by liveness; the peak of offload's host buffers apart
    (``host_peak``; a copy's host result and a ``host_buffer`` are held to the end). ``gloo``:
    the program's collectives run on gloo (a CPU run), whose buffers count as ``comm``."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    persistent: set[int] = set()  # storages bound from outside (state, batch, buffers)
    born: dict[int, tuple[int, int, str]] = {}  # storage -> (position, bytes, category)
    last_use: dict[int, int] = {}
    freed_at: dict[int, int] = {}
    for node in nodes:
        i = position[node]
        for t in tensors_in(val(node)):
            key = storage_id(t)
            if node.op == "placeholder":
                persistent.add(key)
                continue
            if key not in born and key not in persistent:
                # Host buffers of offload are not device memory: tracked apart.
                category = "host" if info(node).pool == HOST else transient_category(node)
                born[key] = (i, t.untyped_storage().nbytes(), category)
            end = max((position[_done(u)] for u in node.users), default=i)
            if node.op == "output" or any(u.op == "output" for u in node.users):
                end = len(nodes)
            if node.op == "call_function" and _held_for_the_run(node):
                end = len(nodes)
            last_use[key] = max(last_use.get(key, i), end)
        if op_kind(node) is OpKind.FREE:
            for t in tensors_in(val(node.args[0])):
                freed_at.setdefault(storage_id(t), i)
    events: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for key, (start, nbytes, category) in born.items():
        # A point is "while node i runs": its inputs and result are live. A storage goes after
        # the last node that reads it, or at the `free` that releases it.
        release = freed_at.get(key, last_use.get(key, start) + 1)
        events[start].append((category, nbytes))
        events[release].append((category, -nbytes))
    for made, taken, nbytes in payloads(gm):  # (expert parallelism's received rows)
        events[position[made] if made is not None else 0].append(("activations", nbytes))
        end = position[_done(taken)] + 1 if taken is not None else len(nodes)
        events[end].append(("activations", -nbytes))
    buffers = _gloo_buffers(nodes, position) if gloo else [0] * len(nodes)
    live = {c: model_states.get(c, 0) for c in ("params", "grads", "optimizer")}
    live.update(gathered=0, activations=0, comm=0, host=0)
    timeline = MemoryTimeline()
    for node in nodes:
        for category, delta in events.get(position[node], []):
            live[category] += delta
        if node.op in ("placeholder", "output"):
            continue
        live["comm"] = buffers[position[node]]
        timeline.append(node_label(node), info(node).phase or "", live)
    return timeline


def _gloo_buffers(nodes: list[fx.Node], position: dict[fx.Node, int]) -> list[int]:
    """Bytes of gloo's buffers at each node: a reduce-scatter's or an all-to-all's from its
    start to its wait (gloo flattens what it sends when the collective is issued); an
    all-gather's while it runs, which on each group is at most :data:`GLOO_THREADS` at once
    (its worker threads), counted as the largest of those in flight."""
    sizes = {node: nbytes for node in nodes if (nbytes := _gloo_buffer_bytes(node))}
    starting: dict[int, list[fx.Node]] = defaultdict(list)
    ending: dict[int, list[fx.Node]] = defaultdict(list)
    for node in sizes:
        starting[position[node]].append(node)
        ending[position[_done(node)]].append(node)
    gathers: dict[str, set[fx.Node]] = defaultdict(set)  # in flight, by group

    def running() -> int:  # (the largest all-gathers in flight, on each group)
        return sum(sum(sorted(sizes[n] for n in g)[-GLOO_THREADS:]) for g in gathers.values())

    held, reductions, gathered = [0] * len(nodes), 0, 0
    for i in range(len(nodes)):
        for node in starting[i]:
            if op_name(node.target) in _GATHERS:
                gathers[node.args[-1]].add(node)
            else:
                reductions += sizes[node]
        if starting[i]:
            gathered = running()
        held[i] = reductions + gathered
        for node in ending[i]:
            if op_name(node.target) in _GATHERS:
                gathers[node.args[-1]].discard(node)
            else:
                reductions -= sizes[node]
        if ending[i]:
            gathered = running()
    return held
