"""Measure a real run of a program: when each op ran, and the tensor memory it kept alive.

:class:`ProfiledRun` interprets a backend's executable node by node (its ``gm``, whose nodes
are the program's; each value dropped after its last use, as generated code does), timing every
op and, after each, summing the bytes of the live storages the run created. Collectives appear on a
communication track from their start to the end of their wait; everything else on the compute
track. The numbers are what ``zerocc estimate`` predicts, measured: the tests hold one to the other.

The time a wait blocks is communication the schedule failed to hide: it is recorded on the
compute track too, as an ``exposed`` event (see :func:`exposed_us`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import fx

from zerocc.compiler.state import HOST
from zerocc.cost.memory import node_label, tensors_in, transient_category
from zerocc.cost.timeline import EXPOSED, MemoryTimeline, TraceEvent
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import info, op_name

if TYPE_CHECKING:
    from zerocc.backends import Executable


class ProfiledRun(fx.Interpreter):
    """Run a backend's ``executable`` once, node by node, recording :class:`TraceEvent` s and
    a measured :class:`MemoryTimeline` (``model_states``: the bytes of the persistent state,
    added to every point). ``program``: the scheduled program the executable was lowered from
    (default: its ``gm``, which may hold compiled regions in place of the program's ops)."""

    def __init__(
        self,
        executable: Executable,
        rank: int,
        model_states: dict[str, int],
        program: fx.GraphModule | None = None,
    ) -> None:
        super().__init__(executable.gm, garbage_collect_values=True)
        self.executable = executable
        self.program = executable.gm if program is None else program
        self.rank = rank
        self.model_states = model_states
        self.events: list[TraceEvent] = []
        self.timeline = MemoryTimeline()
        self._origin = 0
        self._bound: set[int] = set()  # storages passed in (state, batch): not the run's
        self._live: dict[int, tuple[weakref.ref, str]] = {}
        self._comm_start: dict[fx.Node, float] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._bound = {t.untyped_storage()._cdata for a in args for t in tensors_in(a)}
        self._origin = time.perf_counter_ns()
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        start = self._now()
        result = super().run_node(n)
        end = self._now()
        self._track(n, result)
        self._record(n, start, end)
        live = dict(self.model_states)
        live.update(gathered=0, activations=0)
        for ref, category in list(self._live.values()):
            storage = ref()
            if storage is not None:
                live[category] += storage.nbytes()
        self.timeline.append(node_label(n), info(n).phase or "", live)
        return result

    def _now(self) -> float:
        return (time.perf_counter_ns() - self._origin) / 1e3

    def _track(self, n: fx.Node, result: Any) -> None:
        category = transient_category(n)
        for t in tensors_in(result):
            storage = t.untyped_storage()
            key = storage._cdata  # an address: unique among live storages only
            if key in self._bound or key in self._live:
                continue
            self._live[key] = (weakref.ref(storage), category)
            weakref.finalize(storage, self._live.pop, key, None)

    def _record(self, n: fx.Node, start: float, end: float) -> None:
        record = info(n)
        name = op_name(n.target).removeprefix("aten.").removeprefix("zerocc.")
        title = f"{name} {record.unit}" if record.unit else name
        args = {"phase": record.phase or "", "node": n.name}
        if record.stream != Stream.COMM:
            track = "host" if record.pool == HOST else "compute"  # as the simulator's
            self.events.append(TraceEvent(self.rank, track, title, start, end - start, args))
        elif record.bytes:  # a collective's start: its slice ends when its wait returns
            self._comm_start[n] = start
        else:
            started = n.args[0] if isinstance(n.args[0], fx.Node) else None
            begin = self._comm_start.pop(started, start)
            issued = started if started is not None else n
            name = op_name(issued.target).removeprefix("zerocc.").removesuffix("_start")
            args |= {"bytes": info(issued).bytes, "note": info(issued).note or ""}
            title = f"{name} {record.unit}" if record.unit else name
            self.events.append(TraceEvent(self.rank, "comm", title, begin, end - begin, args))
            self.events.append(
                TraceEvent(
                    self.rank, "compute", f"wait {title}", start, end - start, args | EXPOSED
                )
            )


# What StepRunner.profile makes a recorder with: (executable, rank, model-state bytes), and the
# program as ``program=``.
RecorderFactory = Callable[..., ProfiledRun]
