"""offload: optimizer states and parameters in host memory or on NVMe, with their copies.

Acts on the placement :func:`zerocc.compiler.state.placements` gives each unit (``offload.ratio``
of the parameters, ``offload.optimizer`` / ``offload.params``). Runs last, on the scheduled
program, so its copies are placed against the final order of compute and communication:

- **Optimizer** (host or NVMe): the unit's master weights and optimizer states are bound in host
  memory (or read from their files into host buffers) and its update runs on the host. The reduced
  gradient shard is copied to the host right after its last write (the accumulation of the
  reduce-scatter's result: the copy hides behind the rest of backward); the clip coefficient and
  overflow flag follow. The step's inf/NaN check (with the clip's squared norm) is split into one
  check per gradient, right after it is complete, and each copy is waited for before the gradient
  ``offload.grads_in_flight`` on (2) is complete: the device holds at most that many offloaded
  gradients plus one at a time, not all of them to the end of backward. With
  ``offload.grads: device`` the shard stays on the device instead, and is copied through one of
  two host buffers (used in turn) right before the update, its copy issued before the previous
  unit's update so that the two overlap. The updated master is
  then copied into the compute-dtype parameter wherever that lives, and stages 1-2 gather it as
  before. A host update writes a parameter in host memory itself (its ``param_copy``: the cast in
  its own pass), except under ``offload.defer_updates: delayed``, whose step reads the parameter
  while the update runs. Where the parameter is on the device in a narrower dtype than the
  master, the host update writes it into one of two host buffers (``host_buffer``, used in turn:
  a copy's wait comes before the update two units on writes its buffer again), and that is
  copied to the device as it is: the cast in the update's own pass, half the bytes on the link.
  NVMe: a unit's files are read while the previous unit updates (double buffering) and written
  back while the next one does, so at most two units' states are in host memory at once.
- **Parameters** (stage 3, host or NVMe): the unit's shard lives off the device; before each of
  its all-gathers a device copy is made, issued when the previous offloaded shard's copy is
  consumed (a prefetch of one), and it goes when the gather is done.

Copies are start/wait pairs on the ``copy`` stream (:mod:`zerocc.engine.transfers`). No
arithmetic changes: the update runs the same kernel on the same fp32 values, and the compute
copy is cast from the same master, so losses equal those of the program without offload.
"""

from __future__ import annotations

import torch
from torch import fx

from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.passes.support.deferred_updates import carry_updates
from zerocc.compiler.passes.support.gradient_checks import check_gradients_as_they_complete
from zerocc.compiler.passes.support.gradients import solo
from zerocc.compiler.passes.support.host_slots import HostSlots
from zerocc.compiler.plan import OffloadConfig
from zerocc.compiler.state import (
    DEVICE,
    HOST,
    NVME,
    Placement,
    StateSpec,
    declare_placements,
    placements,
)
from zerocc.ir.access import StorageRoots, last_writes_before
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import (
    MASTER,
    PARAM_SHARD,
    comes_after,
    emit,
    info,
    op_name,
    placeholders,
    val,
)
from zerocc.ir.nodes import state_placeholder as new_placeholder
from zerocc.ir.ops import HOST_TO_HOST, NVME_READ, NVME_WRITE, TO_DEVICE, TO_HOST, op

aten = torch.ops.aten
CPU = torch.device("cpu")
# Positions of an update's states, (clip coefficient, overflow flag), compute copy, step count
# and learning rate (weights first, gradient second).
UPDATE_ARGS = {
    "zerocc.adamw_": {"states": (2, 3), "scalars": (5, 6), "copy": 7, "step": 4, "lr": 9},
    "zerocc.sgd_": {"states": (2,), "scalars": (3, 4), "copy": 5, "step": None, "lr": 7},
    # (the registry's other optimizers: as many of the states as it keeps, the rest None)
    "zerocc.optim_update_": {
        "states": (2, 3, 4), "scalars": (6, 7), "copy": 8, "step": 5, "lr": 10,
    },
}


class _Offloader:
    """Rewrites one program for the units' placements."""

    def __init__(
        self,
        gm: fx.GraphModule,
        ctx: PassContext,
        where: dict[str, Placement],
        config: OffloadConfig,
    ) -> None:
        self.gm, self.graph, self.where = gm, gm.graph, where
        self.specs = {s.key: s for s in ctx.layout}  # as placed (`declare_placements`)
        self.unit_key = {u.name: u.key for u in ctx.units}
        self.units = {u.name: u for u in ctx.units}
        self.bound = {info(n).key: n for n in placeholders(gm) if info(n).key in self.specs}
        self.like = next(v for v in map(val, placeholders(gm)) if isinstance(v, torch.Tensor))
        self.device = self.like.device
        self.updates = [
            n
            for n in self.graph.nodes
            if op_name(n.target) in UPDATE_ARGS and where[info(n).unit].offloaded
        ]
        self.grads_on_device = config.grads == "device"
        self.completed: dict[fx.Node, fx.Node] = {}  # gradient -> where it is complete
        self.grads_in_flight = config.grads_in_flight
        self.delayed = config.defer_updates == "delayed"
        self.grad_copies: list[tuple[fx.Node, fx.Node]] = []
        copies = [u.args[UPDATE_ARGS[op_name(u.target)]["copy"]] for u in self.updates]
        self.staging = HostSlots(
            self.graph,
            "offload.staging",
            max((val(c).numel() for c in copies if c is not None), default=0),
            "that host updates write compute copies into",
        )
        self.grad_slots = HostSlots(
            self.graph,
            "offload.grads",
            max((val(u.args[1]).numel() for u in self.updates), default=0),
            "that gradients kept on the device are copied through for their host updates",
        )

    # -- emitting -------------------------------------------------------------------------

    def _start(self, target: str, args: tuple, nbytes: int, note: str, **where) -> fx.Node:
        start = emit(self.graph, op(target), args, stream=Stream.COPY, note=note, **where)
        info(start).bytes = nbytes
        return start

    def _wait(self, start: fx.Node, phase: str | None = None) -> fx.Node:
        record = info(start)
        return emit(
            self.graph,
            torch.ops.zerocc.wait.default,
            (start,),
            stream=Stream.COPY,
            unit=record.unit,
            phase=phase or record.phase,
        )

    def _spec(self, unit: str, name: str) -> StateSpec:
        return self.specs[f"{self.unit_key[unit]}.{name}"]

    def _weights(self, unit: str) -> StateSpec:
        """What the unit's update writes: its master, or (no master: the optimizer states live
        with the parameters, in their dtype) the parameter shard itself."""
        master = f"{self.unit_key[unit]}.master"
        return self.specs[master] if master in self.specs else self._spec(unit, "param")

    # -- placeholders ---------------------------------------------------------------------

    def place_states(self) -> None:
        """Off-device states get CPU fake values; an updated unit without a master weight (an
        fp32 plan) gets one: the update runs on it where the optimizer states live."""
        updated = {info(n).unit for n in self.updates}
        for key, spec in self.specs.items():
            node = self.bound.get(key)
            if node is None and spec.role == MASTER and spec.unit in updated:
                node = self.bound[key] = new_placeholder(self.graph, spec, self.like)
            if node is None or spec.location == DEVICE:
                continue
            with self.like.fake_mode:
                node.meta["val"] = torch.empty(spec.shape, dtype=spec.dtype, device=CPU)

    def _nvme(self, node: object) -> StateSpec | None:
        """The spec of an NVMe-resident state placeholder, else None."""
        if not isinstance(node, fx.Node) or node.op != "placeholder":
            return None
        spec = self.specs.get(info(node).key)
        return spec if spec is not None and spec.location == NVME else None

    def drop_nvme_placeholders(self) -> None:
        """NVMe states are read through their files, never bound: their placeholders go."""
        for node in list(self.bound.values()):
            if self._nvme(node) is not None:
                if node.users:
                    raise AssertionError(f"NVMe state {node.name} is still read directly")
                self.graph.erase_node(node)

    # -- the optimizer --------------------------------------------------------------------

    def offload_updates(self) -> None:
        """Rewrite every offloaded unit's update; NVMe reads one unit ahead, writes one behind."""
        nvme = [u for u in self.updates if self.where[info(u).unit].optimizer == NVME]
        to_host = [u for u in self.updates if self.where[info(u).unit].optimizer != DEVICE]
        # Where each gradient the host reads is complete, found once: what the rewrites insert
        # writes no gradient.
        self.completed = last_writes_before(self.gm, [(u.args[1], u) for u in to_host])
        reads: dict[fx.Node, dict[int, fx.Node]] = {}
        writes: list[fx.Node] = []
        host_scalars: dict[fx.Node, fx.Node] = {}
        for update in self.updates:
            placement = self.where[info(update).unit]
            if update in nvme:
                if update not in reads:
                    reads[update] = self._read_states(update, issue_before=update)
                following = nvme[nvme.index(update) + 1 :]
                if following:  # double buffering: the next unit's files load during this update
                    reads[following[0]] = self._read_states(following[0], issue_before=update)
            param = self._rewrite_update(update, placement, reads.get(update, {}), host_scalars)
            newer = self._write_back(update, param, placement)
            for wait in writes:  # the previous unit's writes end behind this unit's update
                update.next.prepend(wait)
            writes = newer
        output = next(n for n in self.graph.nodes if n.op == "output")
        for wait in writes:
            output.prepend(wait)
        if self.grad_copies and check_gradients_as_they_complete(self.gm):
            self._bound_gradients_in_flight()

    def _bound_gradients_in_flight(self) -> None:
        """Wait for each gradient's copy to the host before the gradient ``grads_in_flight``
        after it is complete (default 2), so that the device holds at most that many reduced
        gradients plus the one being completed: the copies (at the host link's rate) can be
        slower than backward, and gradients left to their updates held the device memory of
        all of them at the end of backward. None: no bound."""
        if self.grads_in_flight is None:
            return
        later = self.grad_copies[self.grads_in_flight :]
        for (_, wait), (last, _) in zip(self.grad_copies, later, strict=False):
            if comes_after(last, wait.args[0]):
                last.prepend(wait)
                info(wait).phase = info(last).phase

    def _read_states(self, update: fx.Node, issue_before: fx.Node) -> dict[int, fx.Node]:
        """Start reading the update's NVMe states (by argument position) before
        ``issue_before``; their waits go right before the update."""
        reads: dict[int, fx.Node] = {}
        layout = UPDATE_ARGS[op_name(update.target)]
        weights = self._weights(info(update).unit)
        for index in (0, *layout["states"]):
            spec = weights if index == 0 else self._nvme(update.args[index])
            if spec is None or spec.location != NVME:
                continue
            with self.graph.inserting_before(issue_before):
                start = self._start(
                    "nvme_read_start",
                    (spec.key, list(spec.shape), spec.dtype, CPU, NVME_READ),
                    spec.nbytes,
                    f"read {spec.key} from NVMe",
                    unit=spec.unit,
                    phase="optimizer",
                )
            info(start).pool = HOST
            with self.graph.inserting_before(update):
                reads[index] = self._wait(start)
        return reads

    def _rewrite_update(
        self,
        update: fx.Node,
        placement: Placement,
        reads: dict[int, fx.Node],
        host_scalars: dict[fx.Node, fx.Node],
    ) -> fx.Node:
        """Point the update at the master and states where they live (NVMe: their reads), and
        off the device at host copies of its gradient and scalars. Returns the compute copy the
        update no longer writes (see :meth:`_write_back`)."""
        layout = UPDATE_ARGS[op_name(update.target)]
        args = list(update.args)
        param = args[layout["copy"]] if args[layout["copy"]] is not None else args[0]
        args[0] = self.bound[self._weights(info(update).unit).key]
        args[layout["copy"]] = None
        for index, node in reads.items():
            args[index] = node
        if placement.optimizer != DEVICE:
            if self.grads_on_device:
                args[1] = self._gradient_through_buffer(update, args[1])
            else:
                args[1] = self._gradient_to_host(update, args[1])
            for index in layout["scalars"]:
                scalar = args[index]
                if isinstance(scalar, fx.Node):
                    if scalar not in host_scalars:
                        with self.graph.inserting_before(update):
                            start = self._start(
                                "copy_start",
                                (scalar, CPU, TO_HOST),
                                4,
                                "the step's clip coefficient / overflow flag, for host updates",
                                phase="optimizer",
                            )
                            info(start).pool = HOST
                            host_scalars[scalar] = self._wait(start)
                    args[index] = host_scalars[scalar]
        update.args = tuple(args)
        if placement.optimizer != DEVICE:
            info(update).pool = HOST  # the update runs on the host (the cost model's host rates)
        return param

    def _gradient_to_host(self, update: fx.Node, grad: fx.Node) -> fx.Node:
        """Copy the reduced gradient to the host right after its last write."""
        last = self.completed[grad]
        unit = info(update).unit
        with self.graph.inserting_before(last.next):
            start = self._start(
                "copy_start",
                (grad, CPU, TO_HOST),
                val(grad).numel() * val(grad).element_size(),
                f"copy {unit}'s reduced gradient to the host once it is complete",
                unit=unit,
                phase=info(last).phase or "backward",
            )
        info(start).pool = HOST
        with self.graph.inserting_before(update):
            wait = self._wait(start, "optimizer")
        self.grad_copies.append((last, wait))
        return wait

    def _gradient_through_buffer(self, update: fx.Node, grad: fx.Node) -> fx.Node:
        """``offload.grads: device``: copy the reduced gradient, kept on the device, into the
        next of the two gradient host buffers, issued right before the previous unit's update
        so that the copy runs beside it. The update two back, the last to read that buffer, has
        finished by then: host updates not deferred run in order on the thread that
        issues the copies."""
        unit, numel = info(update).unit, val(grad).numel()
        previous = self.updates.index(update) - 1
        issue_before = self.updates[previous] if previous >= 0 else update
        if not comes_after(issue_before, self.completed[grad]):
            issue_before = update
        buffer, _ = self.grad_slots.take(val(grad).dtype, issue_before)
        with self.graph.inserting_before(issue_before):
            where = {"unit": unit, "phase": "optimizer", "pool": HOST}
            into = emit(self.graph, aten.slice.Tensor, (buffer, 0, 0, numel), **where)
            if val(grad).dim() != 1:
                into = emit(self.graph, aten.view.default, (into, list(val(grad).shape)), **where)
            start = self._start(
                "copy_into_start",
                (into, grad, TO_HOST),
                numel * val(grad).element_size(),
                f"copy {unit}'s reduced gradient, kept on the device, to a host buffer for "
                "its update",
                unit=unit,
                phase="optimizer",
            )
        info(start).pool = HOST
        with self.graph.inserting_before(update):
            return self._wait(start, "optimizer")

    def _write_back(self, update: fx.Node, param: fx.Node, placement: Placement) -> list[fx.Node]:
        """After the update: the compute copy receives the master (cast to its dtype) wherever
        it lives, and NVMe states go back to their files. Returns the NVMe writes' waits, for
        the caller to place."""
        unit = info(update).unit
        param_spec = self._spec(unit, "param")
        where = {"unit": unit, "phase": "optimizer"}
        writes: list[fx.Node] = []
        copied = self._weights(unit) is not param_spec  # else the update wrote them itself
        if copied and self._writes_in_place(update, param_spec):
            self._set_copy(update, param)
            copied = False
        # The staging buffer first: reusing one may move a wait to before the update.
        staged = (
            self._stage(update, param)
            if copied and self._stages(update, param, param_spec)
            else None
        )
        with self.graph.inserting_before(update.next):
            if copied:
                writes += self._update_compute_copy(update, param, param_spec, where, staged)
            if placement.optimizer == NVME:
                for arg in update.args:
                    if isinstance(arg, fx.Node) and op_name(arg.target) == "zerocc.wait":
                        key = arg.args[0].args[0]
                        if isinstance(key, str):
                            writes.append(self._write(arg, self.specs[key], "write back", where))
        return writes

    def _update_compute_copy(
        self, update: fx.Node, param: fx.Node, spec: StateSpec, where: dict, staged: fx.Node | None
    ) -> list[fx.Node]:
        """The compute copy (``param``, at ``spec.location``) receives what ``update`` wrote:
        its master, cast to its dtype, or ``staged``, the copy the update wrote in a host
        buffer; returns the wait of an NVMe write, for the caller to place."""
        unit, master = where["unit"], update.args[0]
        if spec.location == NVME:
            cast = emit(self.graph, aten._to_copy.default, (master,), pool=HOST, **where)
            cast.kwargs = {"dtype": spec.dtype, "device": CPU}
            return [self._write(cast, spec, f"write {unit}'s parameters", where)]
        direction = TO_DEVICE if spec.location == DEVICE else TO_HOST
        if direction == TO_HOST and info(update).pool == HOST:
            direction = HOST_TO_HOST  # from the master the host update wrote
        source, what = master, "updated master weights"
        if staged is not None:
            source, what = staged, "updated weights (cast by the update)"
        start = self._start(
            "copy_into_start",
            (param, source, direction),
            spec.nbytes,
            f"copy {unit}'s {what} into its compute copy",
            **where,
        )
        if direction == HOST_TO_HOST:
            info(start).pool = HOST
        wait = self._wait(start)
        self._sink(start, wait)
        if source is not master:
            self.staging.last_reader[source.args[0]] = wait
        return []

    def _writes_in_place(self, update: fx.Node, spec: StateSpec) -> bool:
        """Whether ``update``, on the host, writes the compute copy (``spec``) itself, as its
        ``param_copy``: the copy lives in host memory too, so the cast is part of the update's
        own pass rather than a second pass over the master. Not with ``offload.defer_updates:
        delayed``, whose step reads the compute copy while the update runs."""
        return info(update).pool == HOST and spec.location == HOST and not self.delayed

    def _set_copy(self, update: fx.Node, copy: fx.Node) -> None:
        args = list(update.args)
        args[UPDATE_ARGS[op_name(update.target)]["copy"]] = copy
        update.args = tuple(args)

    def _stages(self, update: fx.Node, param: fx.Node, spec: StateSpec) -> bool:
        """Whether ``update``, on the host, writes the compute copy into a host buffer: the
        copy lives on the device, in another dtype than the master the update writes."""
        master = self._weights(info(update).unit)
        return (
            info(update).pool == HOST
            and spec.location == DEVICE
            and master.dtype != val(param).dtype
        )

    def _stage(self, update: fx.Node, param: fx.Node) -> fx.Node:
        """The next host buffer's first elements, as many as ``param`` has, made the
        update's ``param_copy``: what the compute copy is copied from."""
        slot, last = self.staging.take(val(param).dtype, update)
        if last is not None and comes_after(last, update):
            update.prepend(last)  # the copy that read this buffer ends before it is written
        with self.graph.inserting_before(update):
            view = emit(
                self.graph,
                aten.slice.Tensor,
                (slot, 0, 0, val(param).numel()),
                pool=HOST,
                unit=info(update).unit,
                phase="optimizer",
            )
        self._set_copy(update, view)
        return view

    def _write(self, value: fx.Node, spec: StateSpec, what: str, where: dict) -> fx.Node:
        start = self._start(
            "nvme_write_start",
            (value, spec.key, NVME_WRITE),
            spec.nbytes,
            f"{what} {spec.key} to NVMe",
            **where,
        )
        return self._wait(start)

    def _sink(self, start: fx.Node, wait: fx.Node) -> None:
        """Move ``wait`` down to the first node that touches what its copy reads or writes."""
        roots = StorageRoots(self.gm)
        touched = roots.collective_access(start, wait)
        node = wait.next
        while node.op != "output" and not roots.access(node).conflicts(touched):
            node = node.next
        node.prepend(wait)

    # -- parameters -----------------------------------------------------------------------

    def copy_params_in(self) -> None:
        """The reads of an offloaded parameter shard in each phase outside the optimizer (its
        all-gather; at world size 1, which gathers nothing, the views compute reads) read one
        device copy, made just before the first of them and issued when the previous such copy
        is consumed."""
        uses: dict[tuple[fx.Node, str], list[fx.Node]] = {}  # (shard, phase) -> readers
        for node in self.graph.nodes:
            if node.op != "call_function" or info(node).phase == "optimizer":
                continue
            for arg in node.all_input_nodes:
                if self._off_device_param(arg):
                    uses.setdefault((arg, info(node).phase), []).append(node)
        previous: fx.Node | None = None
        for (param, phase), users in uses.items():
            spec = self.specs[info(param).key]
            unit, first = info(param).unit, users[0]
            alone = solo(self.units[unit])
            use = f"its reads in {phase} (one rank gathers nothing)" if alone else None
            note = f"copy {unit}'s parameter shard in for {use or 'its all-gather'}"
            with self.graph.inserting_before(previous or first):
                if spec.location == NVME:
                    args = (spec.key, list(spec.shape), spec.dtype, self.device, NVME_READ)
                    start = self._start("nvme_read_start", args, spec.nbytes, note, unit=unit)
                else:
                    args = (param, self.device, TO_DEVICE)
                    start = self._start("copy_start", args, spec.nbytes, note, unit=unit)
                info(start).phase = phase
            with self.graph.inserting_before(first):
                wait = self._wait(start)
            for user in users:
                user.replace_input_with(param, wait)
            previous = first

    def _off_device_param(self, node: fx.Node) -> bool:
        spec = self.specs.get(info(node).key) if node.op == "placeholder" else None
        return spec is not None and spec.role == PARAM_SHARD and spec.location != DEVICE


@register_pass(
    "offload",
    requires=("optimizer_update",),
    provides=("offloaded",),
    options=lambda plan: {"config": plan.offload},
    enabled=lambda plan: plan.offload.enabled,
    when="the offload section offloads states",
    off_because="offload.optimizer and offload.params are 'none'",
    turn_on="set offload.optimizer (or params)",
    declares=declare_placements,
)
def offload(gm: fx.GraphModule, ctx: PassContext, *, config: OffloadConfig) -> fx.GraphModule:
    """Place offloaded units' states in host memory or on NVMe and insert their copies."""
    where = placements(ctx.units, config)
    if not any(p.offloaded for p in where.values()):
        return gm
    offloader = _Offloader(gm, ctx, where, config)
    offloader.place_states()
    offloader.offload_updates()
    offloader.copy_params_in()
    offloader.drop_nvme_placeholders()
    if config.defer_updates != "none":
        carry_updates(gm, config.defer_updates, UPDATE_ARGS)
    return gm
