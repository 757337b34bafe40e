"""Communication: the process group a program runs against, and what its collectives moved.

The graph's collective ops (``zerocc.all_gather_start`` and friends, see :mod:`zerocc.ir.ops`) run
on the :class:`Comm` of the runtime context an executable was compiled with
(:mod:`zerocc.engine`). Three kinds:

- :class:`TorchComm`: ``torch.distributed``: on CPU (gloo) async work handles; on CUDA (NCCL)
  a dedicated communication stream, ordered against the compute stream by events. zerocc runs
  on a process group of its own (:meth:`TorchComm.create`), made with ``backend.timeout_s`` so
  that no collective waits longer, watched by a heartbeat
  (:mod:`zerocc.engine.watchdog`), and closed (its threads joined) at exit while the
  interpreter is still whole;
- :class:`SoloComm`: world size 1 without a process group;
- :class:`FakeComm`: a null group of any size for graph-level tests and estimates; its
  collectives produce correctly shaped results without any peer.

A program's collectives name their group of the ranks' mesh (:mod:`zerocc.compiler.parallel.mesh`):
``dp``, the ranks a unit is sharded over, under hybrid sharding ``replicate``, the ranks
holding the same shard, and under tensor parallelism ``tp``, the ranks splitting a layer.
:meth:`Comm.use_mesh` splits a comm into them, and :meth:`Comm.on` gives the comm of one;
without either ``dp`` is the comm itself.

Every collective is counted at its call site in :class:`CommStats` (logical elements: an
all-gather counts its output, a reduce-scatter its input, an all-reduce twice its size, as in
the ZeRO paper's 2Ψ/3Ψ accounting), and the time waits blocked the caller in ``blocked_s``:
the communication the schedule left exposed.
"""

from __future__ import annotations

import abc
import contextlib
import pickle
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerocc.compat import all_gather_single, let_gloo_workers_finish, reduce_scatter_single
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.engine.watchdog import SILENT_S, Heartbeat, wait_watched
from zerocc.ir.ops import DP_GROUP, reported_kind

RECENT = 8  # collectives each rank keeps in its log for a hang's diagnosis


@dataclass
class CommStats:
    """Elements and bytes moved per collective kind since the last :meth:`reset`; and the
    rank's last ``RECENT`` collectives ever issued, numbered in issue order (``recent``: (number,
    kind, bytes); never reset), which the heartbeat tells the other ranks, so that a rank that
    waited too long can say where the ranks' collectives part (a flight recorder's idea)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    blocked_s: float = 0.0  # seconds waits blocked the caller (on CUDA: the host, not the GPU)
    issued: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def record(self, kind: str, elements: int, itemsize: int) -> None:
        self.calls[kind] += 1
        self.elements[kind] += elements
        self.bytes[kind] += elements * itemsize
        self.log(kind, elements * itemsize)

    def log(self, kind: str, nbytes: int) -> None:
        """Number and keep a collective in ``recent`` (also those not counted: agreements)."""
        self.issued += 1
        self.recent.append((self.issued, kind, nbytes))

    def reset(self) -> None:
        self.calls.clear()
        self.elements.clear()
        self.bytes.clear()
        self.blocked_s = 0.0

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            "calls": dict(self.calls),
            "elements": dict(self.elements),
            "bytes": dict(self.bytes),
        }

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What the body moves is not counted: the figures are as before it after (in place,
        so that every group's comm, which shares this object, keeps counting here)."""
        saved, blocked = self.snapshot(), self.blocked_s
        try:
            yield
        finally:
            self.reset()
            for name, counts in saved.items():
                getattr(self, name).update(counts)
            self.blocked_s = blocked


class Work:
    """A handle on an issued collective; :meth:`wait` blocks until it is done. On CUDA the
    handle is the event recorded on the communication stream after the collective, and waiting
    makes the current (compute) stream wait for it, without blocking the host. A wait that
    fails (a peer that stopped answering for the group's timeout, or left) is recorded on the
    comm (``comm.failure``) before it raises; a CPU wait gives up as soon as the comm's
    heartbeat names a silent peer (:func:`zerocc.engine.watchdog.wait_watched`)."""

    def __init__(
        self,
        handle: dist.Work | None = None,
        event: torch.cuda.Event | None = None,
        comm: Comm | None = None,
    ) -> None:
        self._handle = handle
        self._event = event
        self._comm = comm

    def wait(self) -> None:
        if self._handle is not None:
            try:
                wait_watched(self._handle, self._comm.heartbeat if self._comm else None)
            except Exception as exc:
                if self._comm is not None:
                    self._comm.root.failure = exc
                raise
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


class Comm(abc.ABC):
    """Base of the process-group adapters: rank, world size, counted collectives.

    ``heartbeat`` (a :class:`zerocc.engine.watchdog.Heartbeat`, None without peers)
    tells who still answers; ``failure`` is the first exception a collective raised: the group
    is unusable after it."""

    rank: int = 0
    world_size: int = 1
    heartbeat: Heartbeat | None = None
    failure: BaseException | None = None

    @property
    def on_gloo(self) -> bool:
        """Whether the programs' collectives run on gloo, which holds buffers of its own while
        they run (predicted as ``comm`` memory, see :mod:`zerocc.cost.memory`)."""
        return False

    def __init__(self) -> None:
        self.stats = CommStats()
        self._before_next_collective: Callable[[], None] | None = None
        self.mesh: Mesh | None = None  # set by use_mesh: the groups below
        self._groups: dict[str, Comm] = {}
        self._parent: weakref.ref[Comm] | None = None  # a group's: the comm it was split from
        self.group_name = DP_GROUP  # what its collectives count as (see reported_kind)

    @property
    def root(self) -> Comm:
        """The comm of every rank: this one, or the one a group's comm was split from (a weak
        reference: a cycle would keep a dropped step's process groups alive until the cycle
        collector ran)."""
        parent = self._parent() if self._parent is not None else None
        return self if parent is None else parent

    def on(self, name: str) -> Comm:
        """The comm of this rank's group ``name`` of the mesh (``dp``: the ranks a unit is
        sharded over; ``replicate``: the ranks holding the same shard; ``tp``: the ranks
        splitting a layer): this comm itself, every rank, until :meth:`use_mesh` split it."""
        if name == DP_GROUP:
            return self._groups.get(name, self)
        found = self._groups.get(name)
        if found is None:
            raise RuntimeError(f"zerocc: no {name!r} group: the ranks were not split into a mesh")
        return found

    def use_mesh(self, mesh: Mesh) -> None:
        """Split the ranks into ``mesh``'s groups (a collective: every rank calls it, with the
        same mesh). Collectives on a group count in this comm's stats; a group's failure is
        this comm's. Once only: another mesh afterwards is an error."""
        if self.mesh is not None:
            if self.mesh != mesh:
                raise RuntimeError(
                    f"zerocc: this comm's ranks are split as {self.mesh} already (another step "
                    f"compiled on it); a plan laid out as {mesh} needs a comm of its own"
                )
            return
        if mesh.world_size != self.world_size:
            raise RuntimeError(f"zerocc: a mesh of {mesh.world_size} ranks for {self.world_size}")
        self.mesh = mesh
        if not mesh.split:
            return
        for name in mesh.named_groups():
            for ranks in mesh.groups(name):  # every rank makes every group, in one order
                made = self._make_group(ranks)
                if made is not None:
                    made.stats, made.heartbeat = self.stats, self.heartbeat
                    made._parent = weakref.ref(self)
                    made.group_name = name
                    self._groups[name] = made

    def _make_group(self, ranks: list[int]) -> Comm | None:
        """A comm over ``ranks`` of this one's ranks; None where this rank is not one of them
        (every rank takes part in making every group)."""
        raise RuntimeError(f"zerocc: a {type(self).__name__} cannot split its ranks into groups")

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        """``out`` (world_size × shard) receives every rank's ``shard``."""
        self._run_check()
        self._count("all_gather", out.numel(), out.element_size())
        return self._all_gather(out, shard)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        """``out`` receives this rank's chunk of the sum of every rank's ``full``."""
        self._run_check()
        self._count("reduce_scatter", full.numel(), full.element_size())
        return self._reduce_scatter(out, full)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """``tensor`` becomes the sum over ranks, in place."""
        self._run_check()
        self._count("all_reduce", 2 * tensor.numel(), tensor.element_size())
        return self._all_reduce(tensor)

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Work:
        """Rows ``in_splits[i]`` of ``inp`` go to rank ``i``; ``out`` receives rank ``i``'s
        ``out_splits[i]`` rows, in rank order (expert parallelism's token exchange)."""
        self._run_check()
        row = inp[0].numel() if inp.dim() > 1 and len(inp) else 1
        sent = (sum(in_splits) - in_splits[self.rank]) * row  # (what leaves this rank)
        self._count("all_to_all", sent, inp.element_size())
        return self._all_to_all(out, inp, out_splits, in_splits)

    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Work:
        raise RuntimeError(f"zerocc: a {type(self).__name__} exchanges no rows (all_to_all)")

    def _count(self, kind: str, elements: int, itemsize: int) -> None:
        self.stats.record(reported_kind(kind, self.group_name), elements, itemsize)

    @contextlib.contextmanager
    def checked_before_first_collective(self, check: Callable[[], None] | None) -> Iterator[None]:
        """Run ``check`` (if any) right before the first collective issued in the body (not at
        all when none is); what it raises stops the body there, before the collective. The
        TrainStep settles the ranks' agreement on a micro-batch this way."""
        self._before_next_collective = check
        try:
            yield
        finally:
            self._before_next_collective = None

    def _run_check(self) -> None:
        check, self._before_next_collective = self._before_next_collective, None
        if check is not None:
            check()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), by rank: what ranks tell each other about
        themselves (not counted in ``stats``). Without peers, this rank's alone (a FakeComm's
        ranks are simulated: they have nothing to tell)."""
        return [obj]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``tensor`` becomes ``src``'s, in place, on every rank (not counted: it runs once, when
        the state is built, not per step). Without peers there is nothing to do."""
        return None

    def send_receive(
        self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]
    ) -> None:
        """Send each tensor of ``sends`` to its rank and fill each of ``receives`` from its
        rank, all at once, returning when all have gone and arrived: CPU tensors the ranks
        hand each other outside the programs (a checkpoint's copies in memory), not counted.
        Without peers there is nothing to send."""
        if sends or receives:
            raise RuntimeError(f"zerocc: a {type(self).__name__} has no peers to send to")

    def close(self) -> None:
        """Release the process group's resources (nothing to release but for TorchComm)."""
        return None

    def side_channel(self) -> Comm:
        """A comm over the same ranks whose exchanges run apart from this one's, so that a
        thread may use it while the step's own collectives go on (a background checkpoint's
        agreement). Making it is a collective: every rank calls it, at the same point. Without
        peers there is nothing to keep apart: this comm itself."""
        return self

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor) -> Work: ...


class TorchComm(Comm):
    """Collectives through ``torch.distributed`` on a process group, issued asynchronously.

    Two groups over the same ranks: ``group`` carries the programs' collectives (NCCL for CUDA
    tensors, gloo for CPU ones); ``control_group``, always gloo, carries what the ranks tell
    each other about themselves (agreements, memory figures, dump events): CPU tensors and
    pickled objects, which NCCL cannot move without copying them to the GPU and syncing the
    host. Without a control group of its own, the data group serves both (it must then be
    gloo)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._release: weakref.finalize | None = None  # set when zerocc made the group
        self._owned: list[dist.ProcessGroup] = []  # the groups the release destroys
        self._timeout: timedelta | None = None  # of zerocc's own groups
        self._closed = False

    @classmethod
    def create(cls, timeout_s: float, device: torch.device) -> TorchComm:
        """zerocc's own process groups over every rank of the default one, whose collectives
        wait at most ``timeout_s`` (the default group's timeout is the user's, 30 minutes for
        gloo), watched by a heartbeat, and closed at interpreter exit: the data group on the
        backend of ``device``'s tensors (NCCL for CUDA, gloo for CPU, whatever the default
        group's), and the gloo control group beside it (see the class).

        Closing matters: a gloo worker thread releases the last collective's tensors after the
        caller has moved on, and releasing a tensor Python has seen needs the interpreter. A group
        still alive when the interpreter finalizes lets that thread meet a dying interpreter
        (``terminate called without an active exception``, SIGABRT after every step finished).
        ``torch._dynamo`` keeps references to the process groups that exist when it is first
        imported (capture imports it), so a group made before that import can never be
        destroyed: it is imported first. The group is released when the comm is closed, when
        it is garbage (a TrainStep dropped), or at interpreter exit, whichever comes first."""
        import torch._dynamo  # noqa: F401  (before the group exists: see above)

        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        group = dist.new_group(backend=backend, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        comm = cls(group, control)
        store = dist.distributed_c10d._get_default_store()
        comm.heartbeat = Heartbeat(
            store,
            f"zerocc/{group.group_name}",
            comm.rank,
            comm.world_size,
            silence_s=min(timeout_s, SILENT_S),
        )
        comm.heartbeat.recent = comm.stats.recent  # (the log, not the comm: no cycle)
        comm._owned, comm._timeout = [group, control], timeout
        comm._release = weakref.finalize(comm, _release_groups, comm._owned, comm.heartbeat)
        return comm

    @property
    def on_gloo(self) -> bool:
        return dist.get_backend(self.group) == "gloo"

    def _make_group(self, ranks: list[int]) -> Comm | None:
        """A group of ``ranks`` (global ranks of this comm's group) on its backend and with its
        timeout, destroyed with it; its own control group is this comm's."""
        if self.group is None:  # the default group: its ranks are the global ones
            members = ranks
        else:
            members = [dist.get_global_rank(self.group, r) for r in ranks]
        made = dist.new_group(members, backend=dist.get_backend(self.group), timeout=self._timeout)
        if made is None or made == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        self._owned.append(made)
        return TorchComm(made, self.control_group)

    def side_channel(self) -> Comm:
        """A gloo group over this comm's ranks, with its timeout, destroyed with it (see
        :meth:`Comm.side_channel`); its objects travel on it alone."""
        if self.world_size == 1:
            return self
        members = list(range(self.world_size))
        if self.group is not None:
            members = [dist.get_global_rank(self.group, r) for r in members]
        made = dist.new_group(members, backend="gloo", timeout=self._timeout)
        self._owned.append(made)
        side = TorchComm(made)
        side.heartbeat = self.heartbeat
        return side

    def close(self) -> None:
        """Stop the heartbeat and destroy the group zerocc made, joining its threads (a group
        that failed is aborted first: its pending collectives would each wait out the
        timeout). The comm is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        groups = [self.group, self.control_group, *(c.group for c in self._groups.values())]
        self.group = self.control_group = None
        self._groups.clear()
        if self.failure is not None and self._release is not None:
            for group in groups:
                if hasattr(group, "abort"):
                    group.abort()
        del groups  # the finalizer holds the last references: the groups die in it
        if self._release is not None:
            self._release()
        elif self.heartbeat is not None:
            self.heartbeat.stop()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, over the gloo control group (on NCCL, objects
        would be pickled into CUDA tensors and the host synced). A failure (a peer that
        stopped answering, or left) is recorded in ``failure`` and raised. Pickled and
        gathered as ``dist.all_gather_object`` does (the sizes, then the padded bytes), but on
        async work waited for through the heartbeat's watch: torch's blocking gather would
        wait out the group's timeout for a peer the watch already names."""
        if self.world_size == 1:
            return [obj]
        self.stats.log("agreement", 0)  # (an object gather on the control group)
        data = pickle.dumps(obj)
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        try:
            self._wait_control(sizes, torch.tensor([len(data)], dtype=torch.int64))
            longest = int(sizes.max())
            mine = torch.zeros(longest, dtype=torch.uint8)
            if data:
                mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            everyone = torch.empty(self.world_size * longest, dtype=torch.uint8)
            self._wait_control(everyone, mine)
        except Exception as exc:
            self.failure = exc
            raise
        rows = everyone.view(self.world_size, longest)
        return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(len(rows))]

    def _wait_control(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """All-gather ``mine`` into ``out`` on the control group, waited for under the watch."""
        work = all_gather_single(out, mine, group=self.control_group, async_op=True)
        wait_watched(work, self.heartbeat)

    def send_receive(
        self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]
    ) -> None:
        """On the gloo control group (see :meth:`Comm.send_receive`); a failure (a peer gone)
        is recorded in ``failure`` and raised."""
        group = self.control_group

        def peer(rank: int) -> int:  # (src= and dst= take global ranks on every release)
            return dist.get_global_rank(group, rank) if group is not None else rank

        try:
            works = [dist.irecv(t, peer(r), group=group) for r, t in receives.items()]
            works += [dist.isend(t, peer(r), group=group) for r, t in sends.items()]
            for work in works:  # (the control group is gloo's)
                wait_watched(work, self.heartbeat, point_to_point=True)
        except Exception as exc:
            self.failure = exc
            raise

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        work = self._issue(
            [tensor], lambda a: dist.broadcast(tensor, src, group=self.group, async_op=a)
        )
        work.wait()

    def _issue(self, tensors: list[torch.Tensor], collective: Callable[[bool], Any]) -> Work:
        """Run ``collective(async_op)`` on CPU as async work; on CUDA on the communication
        stream, after the compute stream's pending work (which produced the inputs)."""
        if self._closed:
            raise RuntimeError("a zerocc collective ran on a closed process group")
        if not tensors[0].is_cuda:
            try:
                return Work(collective(True), comm=self)
            except Exception as exc:
                self.root.failure = exc
                raise
        device = tensors[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            collective(False)  # ordered on `stream`; the host does not wait for the GPU
            done = torch.cuda.Event()
            done.record(stream)
        for t in tensors:
            # Made on the compute stream, used on this one: the caching allocator must not hand
            # their memory out again before this stream is past them (a free right after the
            # wait, or a reduce-scatter input dropped once issued).
            t.record_stream(stream)
        return Work(event=done)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        return self._issue(
            [out, shard],
            lambda a: all_gather_single(out, shard, group=self.group, async_op=a),
        )

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        return self._issue(
            [out, full],
            lambda a: reduce_scatter_single(out, full, group=self.group, async_op=a),
        )

    def _all_reduce(self, tensor: torch.Tensor) -> Work:
        return self._issue(
            [tensor], lambda a: dist.all_reduce(tensor, group=self.group, async_op=a)
        )

    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Work:
        return self._issue(
            [out, inp],
            lambda a: dist.all_to_all_single(
                out, inp, out_splits, in_splits, group=self.group, async_op=a
            ),
        )


class SoloComm(Comm):
    """World size 1: every collective is a copy (or nothing)."""

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return Work()

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        out.copy_(full)
        return Work()

    def _all_reduce(self, tensor: torch.Tensor) -> Work:
        return Work()

    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Work:
        out.copy_(inp)
        return Work()


class FakeComm(Comm):
    """A null process group of any size: results as if every rank held this rank's data."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        super().__init__()
        self.world_size, self.rank = world_size, rank

    def _make_group(self, ranks: list[int]) -> Comm | None:
        return FakeComm(len(ranks), ranks.index(self.rank)) if self.rank in ranks else None

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Work:
        out.view(self.world_size, -1).copy_(shard.reshape(1, -1).clone())
        return Work()

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        out.copy_(full.view(self.world_size, -1)[self.rank] * self.world_size)
        return Work()

    def _all_reduce(self, tensor: torch.Tensor) -> Work:
        tensor.mul_(self.world_size)
        return Work()

    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Work:
        if len(set(out_splits) | set(in_splits)) != 1:  # (as if every rank held this one's rows)
            return super()._all_to_all(out, inp, out_splits, in_splits)
        mine = inp.view(self.world_size, -1)[self.rank]
        out.view(self.world_size, -1).copy_(mine.reshape(1, -1).clone())
        return Work()


def comm_from_environment(timeout_s: float, device: torch.device) -> Comm:
    """zerocc's own groups over the default process group when one is initialized
    (collectives bounded by ``timeout_s``, the data group on ``device``'s backend), else a
    world of one."""
    if dist.is_available() and dist.is_initialized():
        return TorchComm.create(timeout_s, device)
    return SoloComm()


def _release_groups(groups: list[dist.ProcessGroup], heartbeat: Heartbeat) -> None:
    """Stop zerocc's heartbeat and destroy its groups (those the user has not destroyed
    already, with every group); run once, by close, garbage collection or interpreter exit."""
    heartbeat.stop()
    for group in groups:
        if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
    let_gloo_workers_finish()
