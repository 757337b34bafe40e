"""Replay a scheduled program on the streams of one rank and predict how long it takes.

Every rank runs the same program, so one rank is simulated. In program order:

- a compute node runs on the **compute stream**, after the previous one, for its cost;
- a collective's start is issued by the compute stream (which pays ``issue_s`` for it) and runs
  on the **comm stream** from ``max(issue time, comm stream free)``: collectives on a process
  group complete in the order they were issued (FIFO on one stream);
- a wait advances the compute stream to ``max(now, end of its collective)``; the difference is
  communication the schedule did not hide (**exposed**);
- a collective may also take compute-stream time while it runs (``stolen``: on a CPU, gloo
  copies with the cores that compute, see :mod:`zerocc.cost.model`); that time is exposed too,
  charged when the collective is issued.

Offload's copies (:mod:`zerocc.engine.transfers`) run the same way on streams of their own,
as the runtime's: one per direction across the host link (**copy to device**, **copy to host**:
PCIe moves both ways at once) and NVMe I/O on the store's threads (**nvme**), each FIFO, beside
the collectives; a wait on one that is not done is exposed too.

The step lasts until every stream is done. The events use the tracks of a measured run
(:mod:`zerocc.runtime.measure`): compute ops, and a blocking wait as an ``exposed`` compute event,
on "compute"; each collective on "comm", each copy on its stream's, from when it starts moving
bytes to when it ends; the host's work (an offloaded unit's update, a copy between two host
tensors: tagged ``pool: host`` by the offload pass) on "host". The host's work holds the compute
stream as it runs: the runtime does it on the thread that issues the device's work, which waits
meanwhile. An update on the **host stream** (an offload's deferred update, carried into the next
step: it runs on the host's worker) is issued instead: it runs on "host" from ``max(issue time,
host free)``, in the order issued, and its ``host_wait`` advances the compute stream to its end
(the difference counted as ``host_waited_s``, not as exposed communication). A program with
deferred updates begins with the last step's updates, so one run of it is the steady state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.state import HOST
from zerocc.cost.memory import predict_memory
from zerocc.cost.model import COMPUTE, TRANSFER, CostModel, collective_kind, node_work
from zerocc.cost.rates import DeviceRates
from zerocc.cost.timeline import EXPOSED, MemoryTimeline, TraceEvent
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import info, op_kind, op_name
from zerocc.ir.ops import INLINE_COPY_BYTES, TO_DEVICE, TO_HOST

STARTS = (OpKind.COLLECTIVE, OpKind.TRANSFER)  # what the comm and copy streams run
COPY_STREAMS = {TO_DEVICE: "copy to device", TO_HOST: "copy to host"}  # any other: "nvme"

Costs = Callable[[fx.Node], float] | Mapping[fx.Node, float]


@dataclass
class CollectiveRecord:
    """One simulated collective (seconds from the start of the step)."""

    node: str  # name of its start node
    kind: str  # all_gather | reduce_scatter | all_reduce; a copy: to_host | nvme_read | ...
    unit: str | None
    bytes: int  # logical bytes per rank (ZeRO's accounting)
    issued_s: float  # when the compute stream issued it
    start_s: float  # when it began on the comm stream (later if others were queued)
    end_s: float
    waited_s: float = 0.0  # when the compute stream reached its wait
    exposed_s: float = 0.0  # how long that wait blocked


@dataclass
class Simulation:
    """A program (or a step of several) replayed on one rank's compute and comm streams."""

    step_s: float  # until both streams are done
    compute_s: float  # compute stream busy (ops and issuing collectives)
    comm_s: float  # comm stream busy
    exposed_s: float  # what communication adds to the step: blocked waits + stolen compute time
    collectives: list[CollectiveRecord] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list, repr=False)
    peak_bytes: int | None = None  # predicted peak memory (predict_memory), when states given
    memory: MemoryTimeline | None = field(default=None, repr=False)
    stolen_s: float = 0.0  # of exposed_s: compute time collectives took while running
    copy_s: float = 0.0  # copy streams busy, summed (offload's copies and NVMe I/O)
    # Of exposed_s: the compute stream blocked on those copies, by (direction, phase of the
    # wait): ("to_host", "backward") is backward held by gradients on their way out.
    copy_waited: dict[tuple[str, str], float] = field(default_factory=dict)
    # The host's work (offloaded units' updates): of compute_s, but for host-stream updates,
    # which run beside it; and how long the compute stream waited for those.
    host_s: float = 0.0
    host_waited_s: float = 0.0

    @property
    def copy_waited_s(self) -> float:
        """How long the compute stream waited for offload's copies, every direction."""
        return sum(self.copy_waited.values())

    @property
    def exposed_fraction(self) -> float:
        """Exposed communication as a share of the step."""
        return self.exposed_s / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The figures in milliseconds (``zerocc estimate --json``)."""
        return {
            "step_ms": self.step_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "comm_ms": self.comm_s * 1e3,
            "exposed_comm_ms": self.exposed_s * 1e3,
            "exposed_comm_pct": 100 * self.exposed_fraction,
            "stolen_ms": self.stolen_s * 1e3,
            "copy_ms": self.copy_s * 1e3,
            "copy_waited_ms": {
                f"{way} in {phase}": s * 1e3 for (way, phase), s in self.copy_waited.items()
            },
            "host_ms": self.host_s * 1e3,
            "host_waited_ms": self.host_waited_s * 1e3,
            "peak_bytes": self.peak_bytes,
        }


def simulate(
    gm: fx.GraphModule,
    costs: Costs,
    *,
    issue_s: float = 0.0,
    stolen: Costs | None = None,
    model_states: dict[str, int] | None = None,
    rank: int = 0,
) -> Simulation:
    """Replay ``gm`` in program order; ``costs`` gives each node's seconds (a compute node on
    the compute stream, a collective's start node on the comm stream; waits are ignored).
    ``issue_s``: compute-stream time to issue a collective; ``stolen``: compute-stream seconds
    each collective (start node) takes while it runs. With ``model_states`` (bytes per state
    category) the peak memory is predicted too. ``rank`` labels the events."""
    replay = _Replay(_lookup(costs), _lookup(stolen), issue_s, rank)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        kind = op_kind(node)
        if kind in STARTS and node_work(node).kind != COMPUTE:  # (a copy within the host: inline)
            replay.issue(node)
        elif kind is OpKind.WAIT and op_name(node.target) == "zerocc.host_wait":
            replay.host_wait(node)
        elif kind is OpKind.WAIT:
            replay.wait(node)
        elif info(node).stream == Stream.HOST:
            replay.run_on_host(node)
        else:
            replay.run(node)
    memory = predict_memory(gm, model_states) if model_states is not None else None
    return Simulation(
        step_s=max(replay.compute, *replay.free.values()),
        compute_s=replay.busy,
        comm_s=replay.stream_busy["comm"],
        exposed_s=replay.exposed,
        collectives=replay.records,
        events=replay.events,
        peak_bytes=memory.peak()[1] if memory is not None else None,
        memory=memory,
        stolen_s=replay.stolen,
        copy_s=sum(t for stream, t in replay.stream_busy.items() if stream != "comm"),
        copy_waited=dict(replay.copy_waited),
        host_s=replay.host,
        host_waited_s=replay.host_waited,
    )


def _lookup(costs: Costs | None) -> Callable[[fx.Node], float]:
    if costs is None:
        return lambda node: 0.0
    get = costs.get if isinstance(costs, Mapping) else costs
    return lambda node: get(node) or 0.0


class _Replay:
    """The streams of one rank, advanced node by node (seconds)."""

    def __init__(self, cost: Callable, steal: Callable, issue_s: float, rank: int) -> None:
        self.cost, self.steal, self.issue_s, self.rank = cost, steal, issue_s, rank
        self.compute = 0.0  # when the compute stream is next free
        self.free = defaultdict(float, comm=0.0, host=0.0)  # when each other stream is
        self.stream_busy = defaultdict(float, comm=0.0)
        self.host_done: dict[str, float] = {}  # a host-stream update (its name) -> its end
        self.busy = self.exposed = self.stolen = self.host = self.host_waited = 0.0
        self.copy_waited: dict[tuple[str, str], float] = defaultdict(float)
        self.events: list[TraceEvent] = []
        self.records: list[CollectiveRecord] = []
        self.pending: dict[fx.Node, CollectiveRecord] = {}

    def run(self, node: fx.Node) -> None:
        duration = self.cost(node)
        on_host = info(node).pool == HOST
        if duration:
            track = "host" if on_host else "compute"
            self.events.append(_event(self.rank, node, self.compute, duration, track))
        self.compute += duration
        self.busy += duration
        self.host += duration if on_host else 0.0

    def run_on_host(self, node: fx.Node) -> None:
        """A host-stream update: issued now, run by the host's worker in the order issued."""
        duration = self.cost(node)
        begin = max(self.compute, self.free["host"])
        self.free["host"] = self.host_done[node.name] = begin + duration
        self.host += duration
        if duration:
            self.events.append(_event(self.rank, node, begin, duration, "host"))

    def host_wait(self, node: fx.Node) -> None:
        end = self.host_done.pop(node.args[1], None)
        if end is not None and end > self.compute:
            title, seconds = f"wait host update {info(node).unit}", end - self.compute
            args = {**EXPOSED, "node": node.name}
            event = TraceEvent(self.rank, "compute", title, self.compute * 1e6, seconds * 1e6, args)
            self.events.append(event)
            self.compute += seconds
            self.host_waited += seconds

    def issue(self, node: fx.Node) -> None:
        issued, duration = self.compute, self.cost(node)
        if self.issue_s:
            self.events.append(_event(self.rank, node, issued, self.issue_s))
            self.compute += self.issue_s
            self.busy += self.issue_s
        copy = node_work(node).kind == TRANSFER
        stream = COPY_STREAMS.get(node.args[-1], "nvme") if copy else "comm"
        begin = issued
        if copy and info(node).bytes <= INLINE_COPY_BYTES:  # on the compute stream, as issued
            end = issued + duration
        else:
            begin = max(issued, self.free[stream])  # FIFO behind what the stream already has
            self.free[stream] = end = begin + duration
        self.stream_busy[stream] += duration
        kind = node.args[-1] if copy else collective_kind(node)
        record = CollectiveRecord(node.name, kind, info(node).unit, info(node).bytes, issued,
                                  begin, end)  # fmt: skip
        self.pending[node] = record
        if not copy:
            self.records.append(record)
        self.events.append(_comm_event(self.rank, record, stream))
        taken = self.steal(node)
        if taken:
            self._expose(f"transfer {_named(record)}", node, taken, stolen=True)
            self.stolen += taken

    def wait(self, node: fx.Node) -> None:
        start = _started_by(node)
        record = self.pending.pop(start, None)
        if record is None:
            return
        record.waited_s = self.compute
        record.exposed_s = max(0.0, record.end_s - self.compute)
        if record.exposed_s > 0:
            self._expose(f"wait {_named(record)}", node, record.exposed_s)
            if node_work(start).kind == TRANSFER:
                self.copy_waited[record.kind, info(node).phase or ""] += record.exposed_s

    def _expose(self, title: str, node: fx.Node, seconds: float, **args: Any) -> None:
        """The compute stream held ``seconds`` by communication, drawn as measure.py does."""
        args = {**EXPOSED, "node": node.name, **args}
        event = TraceEvent(self.rank, "compute", title, self.compute * 1e6, seconds * 1e6, args)
        self.events.append(event)
        self.compute += seconds
        self.exposed += seconds


def _named(record: CollectiveRecord) -> str:
    return f"{record.kind} {record.unit}" if record.unit else record.kind


def _started_by(wait: fx.Node) -> fx.Node | None:
    """The collective start a wait completes (through views, should a pass put one between)."""
    node = wait.args[0] if wait.args else None
    while isinstance(node, fx.Node):
        if op_kind(node) in STARTS:
            return node
        node = node.args[0] if node.args else None
    return None


def _title(node: fx.Node) -> str:
    name = op_name(node.target).removeprefix("aten.").removeprefix("zerocc.")
    unit = info(node).unit
    return f"{name} {unit}" if unit else name


def _event(
    rank: int, node: fx.Node, start_s: float, seconds: float, track: str = "compute"
) -> TraceEvent:
    args = {"phase": info(node).phase or "", "node": node.name}
    return TraceEvent(rank, track, _title(node), start_s * 1e6, seconds * 1e6, args)


def _comm_event(rank: int, r: CollectiveRecord, track: str = "comm") -> TraceEvent:
    args = {"bytes": r.bytes, "node": r.node, "issued_us": r.issued_s * 1e6}
    return TraceEvent(rank, track, _named(r), r.start_s * 1e6, (r.end_s - r.start_s) * 1e6, args)


def simulate_step(
    programs: Mapping[bool, fx.GraphModule],
    grad_accumulation: int,
    costs: Costs,
    **options: Any,
) -> Simulation:
    """One optimizer step: ``grad_accumulation - 1`` runs of the accumulating program
    (``programs[False]``) then the stepping one (``programs[True]``), back to back, each
    replayed by :func:`simulate` with ``options`` (its keyword arguments). Every program waits
    on all it issues, so the runs add up; the peak memory is the highest of the programs'."""
    order = [False] * (grad_accumulation - 1) + [True]
    once = {b: simulate(programs[b], costs, **options) for b in set(order)}
    if len(order) == 1:
        return once[True]
    total = Simulation(0.0, 0.0, 0.0, 0.0)
    for boundary in order:
        run, offset = once[boundary], total.step_s
        total.events += [_shifted(e, offset * 1e6) for e in run.events]
        total.collectives += [_moved(c, offset) for c in run.collectives]
        total.step_s += run.step_s
        total.compute_s += run.compute_s
        total.comm_s += run.comm_s
        total.exposed_s += run.exposed_s
        total.stolen_s += run.stolen_s
        total.copy_s += run.copy_s
        for key, seconds in run.copy_waited.items():
            total.copy_waited[key] = total.copy_waited.get(key, 0.0) + seconds
        total.host_s += run.host_s
        total.host_waited_s += run.host_waited_s
    peaks = [s for s in once.values() if s.peak_bytes is not None]
    if peaks:
        highest = max(peaks, key=lambda s: s.peak_bytes or 0)
        total.peak_bytes, total.memory = highest.peak_bytes, highest.memory
    return total


def _shifted(e: TraceEvent, offset_us: float) -> TraceEvent:
    args = dict(e.args)
    if "issued_us" in args:
        args["issued_us"] += offset_us
    return TraceEvent(e.rank, e.track, e.name, e.start_us + offset_us, e.duration_us, args)


def _moved(c: CollectiveRecord, offset: float) -> CollectiveRecord:
    return CollectiveRecord(c.node, c.kind, c.unit, c.bytes, c.issued_s + offset,
                            c.start_s + offset, c.end_s + offset, c.waited_s + offset,
                            c.exposed_s)  # fmt: skip


def predict_step(
    programs: Mapping[bool, fx.GraphModule],
    grad_accumulation: int,
    rates: DeviceRates,
    world_size: int,
    *,
    model_states: dict[str, int] | None = None,
    rank: int = 0,
    mesh: Mesh | None = None,
) -> Simulation:
    """:func:`simulate_step` with the cost model of ``rates`` for ``world_size`` ranks (laid
    out as ``mesh`` says: hybrid sharding, tensor parallelism)."""
    model = CostModel(rates, world_size, mesh)
    return simulate_step(programs, grad_accumulation, model, issue_s=model.issue_s,
                         stolen=model.stolen, model_states=model_states, rank=rank)  # fmt: skip
