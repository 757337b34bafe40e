"""offload's deferred updates: each step's host updates carried into the next step
(``offload.defer_updates``).

Without it, a program ends with its offloaded units' host updates, and the next step waits for
all of them: the host's update and the device's compute add up. A program with deferred updates
instead *begins* with the update of the step before (the update a step computes is *carried*
into the next), run on the host's worker thread (``stream=host``) while the device computes:

- the previous step's reduced gradients, clip coefficient, learning rate, step count and skip
  flag are read from host buffers (``host_buffer``, the same every step): the step copies its
  gradients and clip coefficient into them; the runtime sets the others before each run (the
  skip flag is 1 when no update is pending, or when that step overflowed);
- ``next_forward``: each unit's update is waited for (``host_wait``) and its compute copy
  written right before the unit's weights are first read in forward (stage 3: its first
  all-gather): the numbers are those of ``none``, the update hidden behind the forward of the
  units before it. Updates write their compute copy into two host buffers in turn, so one is
  issued once the copy that last read its buffer is done; they are issued in the order forward
  uses the units;
- ``delayed`` (ZeRO-Offload's delayed parameter update): every update is issued at the start,
  each writing the compute copy into a host buffer of its unit's own, waited for right before
  the step copies the unit's new gradient over the one it reads; the compute copy is written
  after the step's last read of the unit's weights, so the step computes on the weights before
  the update, which the next step first uses: gradients one step stale.

Stages 1-2 keep every unit's weights whole on every rank: the update's compute copy is this
rank's shard of them, and an all-gather of the updated shards (the end of a step without
deferred updates) follows the copy, carried with it. ``next_forward`` issues a unit's wait, copy and
all-gather while the unit before it computes, and waits for the all-gather at the unit's first
read; ``delayed`` waits for each all-gather at the step's end.

The carried nodes (``info.carried``) alone make a program of their own
(:func:`carried_program`): what applies a pending update before a save, an evaluation or a
state_dict reads the state. Under stages 1-2 on more than one rank it all-gathers, so every
rank runs it together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from zerocc.compiler.state import HOST, LR_SPEC, STEP_SPEC
from zerocc.errors import InvariantError
from zerocc.ir.access import StorageRoots
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import PARAM_FULL, PARAM_SHARD, copy_node, emit, info, op_kind, op_name, val
from zerocc.ir.ops import TO_HOST

aten = torch.ops.aten

# The carried scalars the runtime sets before each run of a program with deferred updates,
# with dtypes.
CARRIED_SKIP = "offload.carried.skip"  # 1.0: apply nothing
CARRIED_STEP = "offload.carried.step"  # the carried update's AdamW step count
CARRIED_LR = "offload.carried.lr"  # its learning rate
CARRIED_SCALARS = {
    CARRIED_SKIP: torch.float32,
    CARRIED_STEP: STEP_SPEC.dtype,
    CARRIED_LR: LR_SPEC.dtype,
}


def carry_updates(gm: fx.GraphModule, mode: str, update_args: dict[str, dict]) -> None:
    """Carry ``gm``'s host updates into the next step, as ``mode`` (``next_forward`` or
    ``delayed``) places them; ``update_args``: the updates' argument positions (offload's)."""
    updates = [
        n for n in gm.graph.nodes if op_name(n.target) in update_args and info(n).pool == HOST
    ]
    if updates:
        _Carrier(gm, mode, update_args).carry(updates)


def carried_program(gm: fx.GraphModule) -> fx.GraphModule | None:
    """The carried nodes of ``gm`` and the placeholders they read, as a program returning
    nothing: it applies the update pending from the last step (None: ``gm`` carries none)."""
    if not any(info(n).carried for n in gm.graph.nodes):
        return None
    graph, copied = fx.Graph(), {}
    for node in gm.graph.nodes:
        needed = info(node).carried or (
            node.op == "placeholder" and any(info(u).carried for u in node.users)
        )
        if needed:
            copied[node] = copy_node(graph, node, lambda n: copied[n])
    graph.output(None)
    return fx.GraphModule(gm, graph)


@dataclass(eq=False)
class _Carried:
    """One unit's carried update and what follows it: the ``source`` its compute copy is
    copied from (a view of a host buffer the update writes, or its master), that copy
    (``back``, completed by ``back_wait``), under stages 1-2 the all-gather of the copied
    shards (``gather``, completed by ``gather_wait``), the wait for the update. An update
    that writes the compute weights themselves (fp32 states and parameters together on the
    host, or its compute copy in host memory) has no copy: ``back`` is None."""

    update: fx.Node
    view: fx.Node | None
    source: fx.Node
    back: fx.Node | None
    back_wait: fx.Node | None
    gather: fx.Node | None
    gather_wait: fx.Node | None
    fills: list[fx.Node]  # this step's copies into the buffers the update reads
    host_wait: fx.Node | None = None

    @property
    def unit(self) -> str:
        return info(self.update).unit

    @property
    def weights(self) -> fx.Node:
        """The weights the step computes on, which the update's result ends up in."""
        if self.gather is not None:
            return self.gather.args[0]
        return self.back.args[0] if self.back is not None else self.source

    @property
    def after_wait(self) -> list[fx.Node]:
        """What follows the wait for the update: the copy of its result, when there is one,
        and the all-gather of the copies."""
        copy = [self.back, self.back_wait] if self.back is not None else []
        return copy + ([self.gather, self.gather_wait] if self.gather is not None else [])


class _Carrier:
    def __init__(self, gm: fx.GraphModule, mode: str, update_args: dict[str, dict]) -> None:
        self.gm, self.graph, self.mode, self.update_args = gm, gm.graph, mode, update_args
        self.top = next(n for n in self.graph.nodes if n.op != "placeholder")  # the body's first
        self.output = next(n for n in self.graph.nodes if n.op == "output")
        self.scalars: dict[str, fx.Node] = {}
        self.buffer_of: dict[fx.Node, fx.Node] = {}  # this step's host copy (wait) -> buffer
        self.fill_of: dict[fx.Node, fx.Node] = {}  # buffer -> the copy that fills it this step
        self.whole: dict[str, fx.Node] = {  # stages 1-2: each unit's whole weights
            info(n).unit: n
            for n in self.graph.nodes
            if n.op == "placeholder" and info(n).role == PARAM_FULL
        }

    def _order(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    # -- carried inputs -------------------------------------------------------------------

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, key: str, note: str) -> fx.Node:
        """A host buffer of ``key`` made at the program's start (viewed as ``shape``)."""
        numel = math.prod(shape)
        where = {"phase": "optimizer", "carried": True}
        with self.graph.inserting_before(self.top):
            node = emit(
                self.graph,
                torch.ops.zerocc.host_buffer.default,
                (numel, dtype, key),
                pool=HOST,
                note=note,
                **where,
            )
            if not shape:  # a scalar: the buffer's one element
                node = emit(self.graph, aten.select.int, (node, 0, 0), **where)
            elif len(shape) > 1:
                node = emit(self.graph, aten.view.default, (node, list(shape)), **where)
        return node

    def _scalar(self, key: str) -> fx.Node:
        """The carried scalar ``key``, which the runtime sets before each run."""
        if key not in self.scalars:
            what = key.rpartition(".")[2]
            note = f"the carried update's {what}, set by the runtime"
            self.scalars[key] = self._buffer((), CARRIED_SCALARS[key], key, note)
        return self.scalars[key]

    def _carried_input(self, wait: fx.Node, key: str, note: str) -> fx.Node:
        """The buffer of ``key`` that this step's host copy (``wait``, shared by updates)
        fills now, for the next step: a ``copy_into_start`` in place of its ``copy_start``."""
        if wait in self.buffer_of:
            return self.buffer_of[wait]
        start = wait.args[0]
        if op_name(start.target) != "zerocc.copy_start" or start.args[2] != TO_HOST:
            raise InvariantError(f"{wait.name} does not complete a copy to the host")
        copied = val(start.args[0])  # (the copy is new: it has no value yet)
        buffer = self._buffer(tuple(copied.shape), copied.dtype, key, note)
        with self.graph.inserting_before(start):
            into = emit(
                self.graph,
                torch.ops.zerocc.copy_into_start.default,
                (buffer, start.args[0], TO_HOST),
            )
        into.meta["zerocc"] = info(start)
        wait.args = (into,)
        self.graph.erase_node(start)
        self.buffer_of[wait], self.fill_of[buffer] = buffer, into
        return buffer

    # -- the rewrite ----------------------------------------------------------------------

    def carry(self, updates: list[fx.Node]) -> None:
        flags: set[fx.Node] = set()  # this step's found_inf copied to the host
        carried = [self._read_carried_inputs(u, flags) for u in updates]
        for wait in flags:  # no update reads it now: the runtime's skip flag replaces it
            if not wait.users:
                start = wait.args[0]
                self.graph.erase_node(wait)
                if not start.users:
                    self.graph.erase_node(start)
        if self.mode == "delayed":
            self._place_delayed(carried)
        else:
            self._place_next_forward(carried)
        self._check(carried)

    def _read_carried_inputs(self, update: fx.Node, flags: set[fx.Node]) -> _Carried:
        """Point ``update`` at last step's values in host buffers, make it a host-stream
        update, and find the copy of its result."""
        layout, unit = self.update_args[op_name(update.target)], info(update).unit
        args = list(update.args)
        note = f"{unit}'s reduced gradient, for its update in the next step"
        args[1] = self._carried_input(args[1], f"offload.carried.grad.{unit}", note)
        fills = [self.fill_of[args[1]]]
        clip, found = layout["scalars"]
        if isinstance(args[clip], fx.Node):
            note = "the step's clip coefficient, for the next step's updates"
            args[clip] = self._carried_input(args[clip], "offload.carried.clip", note)
            fills.append(self.fill_of[args[clip]])
        if isinstance(args[found], fx.Node):
            flags.add(args[found])
        args[found] = self._scalar(CARRIED_SKIP)
        if layout["step"] is not None:
            args[layout["step"]] = self._scalar(CARRIED_STEP)
        args[layout["lr"]] = self._scalar(CARRIED_LR)
        update.args = tuple(args)
        view = args[layout["copy"]]
        if view is not None and view.op == "placeholder":  # the compute copy, on the host
            source, view = view, None
        else:
            source = view if view is not None else args[0]
        back = next(
            (
                u
                for u in source.users
                if op_name(u.target) == "zerocc.copy_into_start" and u.args[1] is source
            ),
            None,
        )
        back_wait = next(iter(back.users)) if back is not None else None
        gather, gather_wait = self._gather_of(back)
        carried = _Carried(update, view, source, back, back_wait, gather, gather_wait, fills)
        for node in (update, *carried.after_wait, *([view] if view is not None else [])):
            info(node).carried = True
        info(update).stream = Stream.HOST
        return carried

    def _gather_of(self, back: fx.Node | None) -> tuple[fx.Node | None, fx.Node | None]:
        """Stages 1-2: the all-gather (start, wait) that fills the unit's whole weights from
        the shard ``back`` copies into. On one rank the shard is the whole (a view of all of
        it) and there is none: ``back`` then writes the whole weights, the tensor the step
        reads, so that the copy is ordered before those reads by data."""
        if back is None:
            return None, None
        shard, whole = back.args[0], self.whole.get(info(back).unit)
        if whole is None or info(shard).role != PARAM_SHARD:  # stage 3: the step gathers it
            return None, None
        for user in shard.users:
            if op_name(user.target) == "zerocc.all_gather_into_start" and user.args[0] is whole:
                return user, next(iter(user.users))
        if val(whole).shape != val(shard).shape:
            raise InvariantError(f"{back.name} copies a shard of {whole.name}, never gathered")
        back.args = (whole, *back.args[1:])
        return None, None

    def _wait_for(self, carried: _Carried) -> None:
        """Wait for the update at the insertion point; its compute copy reads what the wait
        returns."""
        carried.host_wait = emit(
            self.graph,
            torch.ops.zerocc.host_wait.default,
            (carried.source, carried.update.name),
            stream=Stream.HOST,
            unit=carried.unit,
            phase="optimizer",
            pool=HOST,
            carried=True,
            note=f"{carried.unit}'s update of the step before is done",
        )
        back = carried.back
        if back is not None:
            back.args = (back.args[0], carried.host_wait, *back.args[2:])

    def _body_reads(self, weights: fx.Node, roots: StorageRoots) -> list[fx.Node]:
        """The nodes of this step (not carried) that read ``weights``, through any view of
        them, in program order; a collective's wait with its start (it reads until then)."""
        root, reads = roots.root[weights], []
        for node in self.graph.nodes:
            if info(node).carried or node.op == "output":
                continue
            if root in roots.access(node).reads:
                reads += [node, *(u for u in node.users if op_kind(u) is OpKind.WAIT)]
        order = self._order()
        return sorted(dict.fromkeys(reads), key=order.__getitem__)

    def _place_next_forward(self, updates: list[_Carried]) -> None:
        """Each update issued in the order forward first reads the units' weights, once the
        copy that last read its host buffer is done; waited for, and its compute copy written,
        right before that read (stages 1-2: while the unit before computes, its all-gather
        waited for at the read)."""
        roots = StorageRoots(self.gm)
        first_read = {}
        for carried in updates:
            reads = self._body_reads(carried.weights, roots)
            first_read[carried] = reads[0] if reads else self.output
        order = self._order()
        updates.sort(key=lambda c: order[first_read[c]])
        slots = list(dict.fromkeys(c.view.args[0] for c in updates if c.view is not None))
        for slot in slots:
            self.top.prepend(slot)
            info(slot).carried = True
        last_read: dict[fx.Node, fx.Node] = {}  # slot -> the wait of the copy that read it last
        previous: _Carried | None = None
        staged = 0
        for carried in updates:
            after, view = [previous.update] if previous is not None else [], carried.view
            if view is not None:
                slot = slots[staged % len(slots)]
                staged += 1
                view.args = (slot, *view.args[1:])
                after += [last_read[slot]] if slot in last_read else []
                last_read[slot] = carried.back_wait
            anchor = self._after_all(after)
            if view is not None:
                anchor.prepend(view)
            anchor.prepend(carried.update)
            read = first_read[carried]
            # An all-gather is started a unit ahead, beside the compute of the unit before.
            ahead = first_read[previous] if carried.gather is not None and previous else read
            with self.graph.inserting_before(ahead):
                self._wait_for(carried)
            for node in carried.after_wait:
                (read if node is carried.gather_wait else ahead).prepend(node)
            if carried.gather_wait is not None:
                note = f"{carried.unit}'s updated weights, before their first read"
                info(carried.gather_wait).note = note
            previous = carried

    def _after_all(self, nodes: list[fx.Node]) -> fx.Node:
        """The node right after the last of ``nodes`` (the body's first when there are none)."""
        if not nodes:
            return self.top
        order = self._order()
        return max(nodes, key=order.__getitem__).next

    def _place_delayed(self, updates: list[_Carried]) -> None:
        """Every update issued at the start, each writing a compute copy of its own, in the
        order backward refills the units' gradient buffers; each waited for right before that
        refill, its compute copy written after the step's last read of the weights."""
        slots = {c.view.args[0] for c in updates if c.view is not None}
        order = self._order()
        updates.sort(key=lambda c: order[c.fills[0]])
        for carried in updates:
            view = carried.view
            if view is not None:
                numel, dtype = view.args[3], view.args[0].args[1]  # slice(host_buffer(n, dtype))
                key = f"offload.carried.copy.{carried.unit}"
                note = f"{carried.unit}'s compute copy, written by its carried update"
                view.args = (self._buffer((numel,), dtype, key, note), 0, 0, numel)
                self.top.prepend(view)
            self.top.prepend(carried.update)
        for slot in slots:
            if not slot.users:
                self.graph.erase_node(slot)
        roots = StorageRoots(self.gm)
        for carried in updates:
            if carried.back is None:  # (the plan refuses it: the step reads those weights)
                raise InvariantError(f"{carried.update.name}: a delayed update needs a copy")
            with self.graph.inserting_before(carried.fills[0]):
                self._wait_for(carried)
            # The compute copy is written after the step's last read of the weights (a gather
            # reads them until its wait), so this step computes on the weights before.
            reads = [carried.host_wait, *self._body_reads(carried.weights, roots)]
            self._after_all(reads).prepend(carried.back)
            self.output.prepend(carried.back_wait)
        # Stages 1-2: each all-gather follows its copy, started once the next copy is issued.
        order = self._order()
        gathered = sorted((c for c in updates if c.gather), key=lambda c: order[c.back])
        for carried, following in zip(gathered, [*gathered[1:], None], strict=False):
            start_at = following.back if following is not None else self.output
            start_at.prepend(carried.back_wait)
            start_at.prepend(carried.gather)
            self.output.prepend(carried.gather_wait)
            info(carried.gather_wait).note = f"{carried.unit}'s updated weights, for the next step"

    def _check(self, updates: list[_Carried]) -> None:
        """Every update is waited for before this step's copies overwrite what it reads."""
        order = self._order()
        for carried in updates:
            for fill in carried.fills:
                if not order[carried.update] < order[carried.host_wait] < order[fill]:
                    raise InvariantError(
                        f"{carried.update.name}, carried, is not done before {fill.name} "
                        "overwrites what it reads"
                    )
