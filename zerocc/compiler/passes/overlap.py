"""overlap: hide communication behind compute by moving collective starts up and waits down.

The shard and optimizer passes emit every collective as a start right before its wait. This pass
reschedules the pairs; it moves compute relative to compute only across expert parallelism's
exchanges (step 5), ops that read and write disjoint storage, so losses stay bit-identical to the
unoverlapped program:

1. **Buckets** (``bucket_mb`` > 0): runs of consecutive small units' all-gathers, and of their
   gradient reduce-scatters, become one collective each (see
   :mod:`zerocc.compiler.passes.support.bucketing`).
2. **Prefetch**: each parameter all-gather (forward and backward) is issued as early as
   (a) its inputs allow: never above a node that writes the shard it reads, (b) ``prefetch``
   allows: no earlier than the wait of the gather ``prefetch`` units before it, so at most that
   many units are gathered ahead of the one being computed, and (c) the budget allows.
3. **Early tensor-parallel collectives**: each is issued as soon as what it reads is computed
   (with the copy it sums in place and the views of a matmul's output it copies): backward's
   all-reduce of a colwise layer's input gradient then runs behind the weight gradient.
4. **Late waits**: every wait moves down to just before the first node that needs what the
   collective produced or touches what it reads or writes; a reduced gradient's accumulation
   into the gradient shard (an in-place add, independent of all compute) moves with its wait.
   A collective that holds memory in flight (a reduce-scatter holds its gradient bucket) is
   waited on no later than the next collective of its kind is issued, so one is in flight at a
   time, as in FSDP2: each reduce-scatter finishes behind the next unit's backward. In-place
   collectives hold nothing: stage 0's all-reduces finish behind the rest of backward, stages
   1-2's all-gathers of updated shards behind the remaining updates.

5. **Expert parallelism's exchanges**: each experts call's rows go out before the compute
   above them that they do not need (a shared expert computed before the router), which moves
   below the exchange's start and runs while the rows are in flight; and the ops that read the
   rows that come back (their weighting and sum) move, with the wait, below the compute that
   does not read them, down to the first op that reads both.

The budget, ``max_inflight_mb``, bounds the bytes held by collectives in flight (issued, not
yet waited on) at every point of the program: a prefetched unit's gathered buffer, a gradient
bucket and its reduced shard. In-place collectives (stage 0's all-reduce, stages 1-2's gathers
into the persistent parameters) hold nothing extra. Gathers are placed first (a stalled gather
stalls compute at once), then waits, each in program order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.passes.support.bucketing import bucket_collectives
from zerocc.ir.access import StorageRoots
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import GRAD, info, op_kind, op_name, val
from zerocc.ir.ops import (
    EXPERT_OP_NAMES,
    PARAM_GATHERS,
    TO_EXPERTS,
    TO_TOKENS,
    TP_GROUP,
    UNIT_GROUPS,
    op,
)
from zerocc.ir.verify import check_well_formed

aten = torch.ops.aten
MB = 2**20


@dataclass
class Collective:
    """A start/wait pair, the nodes that move with its wait, and the bytes it holds in flight."""

    start: fx.Node
    wait: fx.Node
    leaders: list[fx.Node]  # a bucket's copy-in, issued with its start
    followers: list[fx.Node]  # accumulations of the result into gradient state, and their views
    inflight_bytes: int

    @property
    def is_prefetch(self) -> bool:
        """A parameter all-gather into a new buffer (stage 3, forward or backward)."""
        return (
            op_name(self.start.target) in PARAM_GATHERS
            and info(self.start).phase in ("forward", "backward")
            and self.start.args[-1] in UNIT_GROUPS  # (tensor parallelism's gathers its logits)
        )


def _nbytes(node: fx.Node) -> int:
    value = val(node)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _accumulates(user: fx.Node, value: fx.Node, roots: StorageRoots) -> bool:
    """Whether ``user`` adds (or copies) ``value`` into a gradient in place (gradient state, or
    the packed gradient a bucket's all-reduce copies back into), or casts it to the dtype the
    update reads it in: independent of all compute, it can follow its wait anywhere."""
    if user.target is aten._to_copy.default:
        return user.args[0] is value
    if user.target not in (aten.add_.Tensor, aten.copy_.default) or user.args[1] is not value:
        return False
    destination = roots.root[user.args[0]]
    return info(destination).role == GRAD or destination.target is op("pack")


def _followers(wait: fx.Node, roots: StorageRoots) -> list[fx.Node]:
    """The accumulations of a collective's result (or of slices of it) into gradients."""
    followers = []
    for user in wait.users:
        if _accumulates(user, wait, roots):
            followers.append(user)
        elif (
            user.target is aten.slice.Tensor
            and user.users
            and all(_accumulates(u, user, roots) for u in user.users)
        ):
            followers += [user, *user.users]
    return followers


def _leaders(start: fx.Node) -> list[fx.Node]:
    """What is issued with a start wherever it goes: a bucket's copy-in of persistent shards,
    or the copy a tensor-parallel all-reduce sums in place."""
    source = start.args[0]
    if not isinstance(source, fx.Node) or len(source.users) != 1:
        return []
    if source.target is aten.cat.default and all(
        a.op == "placeholder" for a in source.all_input_nodes
    ):
        return [source]
    if source.target is aten.clone.default and start.args[-1] == TP_GROUP:
        leaders = [source]  # and the views it copies (of a matmul's output), if only it reads
        while (
            (view := leaders[0].args[0]) is not None
            and isinstance(view, fx.Node)
            and (op_kind(view) is OpKind.VIEW and len(view.users) == 1)
        ):
            leaders.insert(0, view)
        return leaders
    return []


def find_collectives(gm: fx.GraphModule, roots: StorageRoots) -> list[Collective]:
    """The program's collectives in order of their starts."""
    found = []
    for start in gm.graph.nodes:
        if info(start).stream != Stream.COMM or not info(start).bytes:
            continue
        (wait,) = start.users
        held = _nbytes(start) if roots.root[start] is start else 0
        # A collective keeps its input alive until its wait; a unit's packed gradient reduced
        # in place lives on to the update anyway (stage 0 without accumulation).
        held += sum(
            _nbytes(a)
            for a in start.all_input_nodes
            if a.op != "placeholder" and not (roots.root[start] is a and a.target is op("pack"))
        )
        found.append(Collective(start, wait, _leaders(start), _followers(wait, roots), held))
    return found


class _Schedule:
    """Positions of the program's nodes and the in-flight bytes at each, kept current as nodes
    move: a move touches only the span between where the nodes were and where they went."""

    def __init__(self, gm: fx.GraphModule, collectives: list[Collective]) -> None:
        self.graph = gm.graph
        self.issued: dict[fx.Node, int] = {}  # bytes a start begins to hold
        self.released: dict[fx.Node, int] = {}  # bytes held through a wait, freed after it
        for c in collectives:
            self.issued[c.start] = self.issued.get(c.start, 0) + c.inflight_bytes
            self.released[c.wait] = self.released.get(c.wait, 0) + c.inflight_bytes
        self.nodes = list(self.graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.inflight = [0] * len(self.nodes)
        self._recount(0, len(self.nodes))

    def _recount(self, lo: int, hi: int) -> None:
        """``inflight[i]`` for ``lo <= i < hi``: bytes held by collectives while node ``i``
        runs (from its start through its wait; a node placed before node ``i`` runs alongside
        those too). Outside a span that nodes moved within, nothing changes."""
        running = 0
        if lo > 0:
            running = self.inflight[lo - 1] - self.released.get(self.nodes[lo - 1], 0)
        for i in range(lo, hi):
            node = self.nodes[i]
            running += self.issued.get(node, 0)
            self.inflight[i] = running
            running -= self.released.get(node, 0)

    def move_before(self, moving: list[fx.Node], i: int) -> None:
        """Place ``moving``, in order, right before the node at position ``i``."""
        before = self.nodes[i]
        lo = min(i, *(self.position[n] for n in moving))
        hi = max(i, *(self.position[n] + 1 for n in moving))
        for node in moving:
            before.prepend(node)
        first = self.nodes[lo - 1].next if lo > 0 else next(iter(self.graph.nodes))
        span, node = [], first
        for _ in range(hi - lo):
            span.append(node)
            node = node.next
        self.nodes[lo:hi] = span
        self.position.update((n, lo + k) for k, n in enumerate(span))
        self._recount(lo, hi)

    def over_budget(self, i: int, nbytes: int, budget: float) -> bool:
        return self.inflight[i] + nbytes > budget


def hoist_gathers(
    gm: fx.GraphModule,
    collectives: list[Collective],
    roots: StorageRoots,
    prefetch: int,
    budget: float,
) -> None:
    """Issue each parameter all-gather as early as its inputs, ``prefetch`` and the budget
    allow."""
    if prefetch == 0:
        return
    schedule = _Schedule(gm, collectives)
    gathers = [c for c in collectives if c.is_prefetch]
    for k, c in enumerate(gathers):
        floor = schedule.position[gathers[k - prefetch].wait] + 1 if k >= prefetch else 0
        _issue_at(schedule, c, _earliest(schedule, c, roots, floor), budget, "prefetched")


def issue_tp_early(
    gm: fx.GraphModule, collectives: list[Collective], roots: StorageRoots, budget: float
) -> None:
    """Issue each tensor-parallel collective right after what it reads is computed: backward's
    all-reduce of a colwise layer's input gradient then runs behind the layer's weight
    gradient, as Megatron overlaps them."""
    schedule = _Schedule(gm, collectives)
    for c in collectives:
        if c.start.args[-1] == TP_GROUP:
            _issue_at(schedule, c, _earliest(schedule, c, roots), budget, "early")


def _earliest(schedule: _Schedule, c: Collective, roots: StorageRoots, floor: int = 0) -> int:
    """The earliest position a collective (and its leaders) can be issued at: right after the
    last node it reads or whose access conflicts with its own, and not before ``floor`` (the
    scan stops there: what lies before does not matter)."""
    flight = roots.collective_access(c.start, c.wait)
    inputs = set(c.start.all_input_nodes)
    for node in c.leaders:
        flight = flight | roots.access(node)
        inputs.update(node.all_input_nodes)
    earliest = schedule.position[(c.leaders or [c.start])[0]]
    while earliest > floor:
        before = schedule.nodes[earliest - 1]
        if before.op == "placeholder" or before in inputs or roots.access(before).conflicts(flight):
            break
        earliest -= 1
    return earliest


def _issue_at(schedule: _Schedule, c: Collective, earliest: int, budget: float, how: str) -> None:
    """Move the collective's start (and leaders) up to ``earliest``, or as far as the budget
    allows, and say so in its note."""
    moving = [*c.leaders, c.start]
    here = schedule.position[moving[0]]
    for i in range(here - 1, earliest - 1, -1):
        if schedule.over_budget(i, c.inflight_bytes, budget):
            earliest = i + 1
            break
    if earliest < here:
        after = schedule.nodes[earliest - 1]
        schedule.move_before(moving, earliest)
        info(c.start).note = f"{info(c.start).note}; {how}: issued right after {after}"


def sink_waits(
    gm: fx.GraphModule, collectives: list[Collective], roots: StorageRoots, budget: float
) -> None:
    """Move each wait (with its accumulations) down to just before the first node that needs
    it, as far as the budget allows."""
    schedule = _Schedule(gm, collectives)
    for c in collectives:
        if c.is_prefetch:  # waited on right before its first use already
            continue
        moving = [c.wait, *c.followers]
        access = roots.collective_access(c.start, c.wait)
        for node in c.followers:
            access = access | roots.access(node)
        last = max(schedule.position[n] for n in moving)
        target = last + 1
        while target < len(schedule.nodes):
            node = schedule.nodes[target]
            needs = any(a in moving for a in node.all_input_nodes)
            if node.op == "output" or needs or roots.access(node).conflicts(access):
                break
            if c.inflight_bytes and node.target is c.start.target:
                break  # one reduction holding memory in flight at a time, as FSDP2
            target += 1
        why = "the first node that needs it"
        for i in range(last + 1, target):
            if schedule.over_budget(i, c.inflight_bytes, budget):
                target, why = i, "as late as max_inflight_mb allows"
                break
        if target > last + 1:
            info(c.wait).note = f"waited on late: right before {schedule.nodes[target]}, {why}"
            schedule.move_before(moving, target)


def send_expert_rows_early(collectives: list[Collective], roots: StorageRoots) -> None:
    """Expert parallelism: each experts call's rows go out (an all-to-all) while the compute
    before it that it does not need runs (a shared expert computed before the router). That
    compute moves down, in its order, to right after the exchange's start; what the start
    needs (the router, the sort, the counts' exchange) stays above it. Ops that read and write
    disjoint storage compute the same values in either order."""
    for c in collectives:
        if op_name(c.start.target) != TO_EXPERTS:
            continue
        # Found last first: what the start needs stays (the chain), what it does not moves
        # below it, past the chain's nodes found so far (those it must not conflict with).
        chain, passed = {c.start}, []
        chain_access = roots.access(c.start)
        node = c.start.prev
        while (
            node.op == "call_function"
            and info(node).phase == info(c.start).phase
            and op_name(node.target) not in EXPERT_OP_NAMES  # (the call before: as far as it goes)
        ):
            access = roots.access(node)
            if any(user in chain for user in node.users):
                chain.add(node)
                chain_access = chain_access | access
            elif _plain(node, c.start) and not access.conflicts(chain_access):
                passed.append(node)
            else:
                break
            node = node.prev
        after = c.start
        for moving in reversed(passed):  # (found last first)
            after.append(moving)
            after = moving
        if passed:
            info(c.start).note = (
                f"{info(c.start).note}; issued before {len(passed)} ops that it does not need "
                f"(from {passed[-1]})"
            )


def defer_expert_results(collectives: list[Collective], roots: StorageRoots) -> None:
    """Expert parallelism: each experts call's rows come back (an all-to-all) while what follows
    and does not read them runs (a shared expert after the experts, in forward or backward).
    The wait and the ops that read what it brought (their weighting and sum) move down past the
    compute that does not, to the first op that reads both."""
    for c in collectives:
        if op_name(c.start.target) != TO_TOKENS:
            continue
        # What reads the wait's result moves (the chain), what does not stays, the chain's
        # nodes found so far moving below it (what it must not conflict with).
        chain, passed = [c.wait], set()
        chain_access = roots.collective_access(c.start, c.wait)
        node = c.wait.next
        while node.op != "output" and _plain(node, c.wait):
            access = roots.access(node)
            if any(a in chain for a in node.all_input_nodes):
                if any(a in passed for a in node.all_input_nodes):
                    break  # the first op that reads both
                chain.append(node)
                chain_access = chain_access | access
            elif access.conflicts(chain_access):
                break
            else:
                passed.add(node)
            node = node.next
        if passed:
            for moving in chain:
                node.prepend(moving)
            info(c.wait).note = (
                f"waited on late: after {len(passed)} ops that do not read the experts' results, "
                f"right before {node}"
            )


def _plain(node: fx.Node, wait: fx.Node) -> bool:
    """Compute (or a free) of the exchange's phase on the compute stream, without side
    effects: what may run on either side of an exchange's start or wait."""
    kind = op_kind(node)
    return (
        kind in (OpKind.COMPUTE, OpKind.VIEW, OpKind.PLUMBING, OpKind.FREE)
        and node.op == "call_function"
        and info(node).stream == Stream.COMPUTE
        and info(node).phase == info(wait).phase
        and (kind is OpKind.FREE or not node.is_impure())  # (a free: what it frees is checked)
    )


def inflight_peak(gm: fx.GraphModule) -> int:
    """The most bytes held by collectives in flight at any point of ``gm``."""
    collectives = find_collectives(gm, StorageRoots(gm))
    return max(_Schedule(gm, collectives).inflight, default=0)


def _options(plan) -> dict:
    config = plan.overlap
    return {
        "prefetch": config.prefetch,
        "max_inflight_mb": config.max_inflight_mb,
        "bucket_mb": config.bucket_mb,
    }


@register_pass(
    "overlap",
    requires=("optimizer_update",),
    provides=("overlapped",),
    forbids=("offloaded",),  # offload places its copies against the overlapped schedule
    options=_options,
    enabled=lambda plan: plan.overlap.enabled,
    when="overlap.enabled is true (the default)",
    off_because="overlap.enabled is false",
    turn_on="set overlap.enabled: true",
    optional=True,  # a plan's own `passes` may leave the schedule as the other passes made it
)
def overlap(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    prefetch: int,
    max_inflight_mb: float | None,
    bucket_mb: float,
) -> fx.GraphModule:
    """Bucket small units' collectives, prefetch all-gathers under a memory budget, and wait
    on every collective as late as possible; compute moves only across expert parallelism's
    exchanges, to run while they are in flight."""
    if bucket_mb > 0:
        bucket_collectives(gm, bucket_mb * MB)
    budget = float("inf") if max_inflight_mb is None else max_inflight_mb * MB
    roots = StorageRoots(gm)
    collectives = find_collectives(gm, roots)
    hoist_gathers(gm, collectives, roots, prefetch, budget)
    issue_tp_early(gm, collectives, roots, budget)
    sink_waits(gm, collectives, roots, budget)
    send_expert_rows_early(collectives, roots)
    defer_expert_results(collectives, roots)
    check_well_formed(gm, after="overlap")
    return gm
