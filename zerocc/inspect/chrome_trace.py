"""Write trace events in Chrome's Trace Event Format, for ui.perfetto.dev and chrome://tracing.

Each rank is a process ("rank N") with two threads: "compute" (tid 0) above "comm" (tid 1), so
the overlap of collectives with compute reads off the two rows. Every event is a complete
("X") event in microseconds; its ``args`` (bytes, phase, unit, ...) show when it is clicked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zerocc.cost.timeline import TraceEvent

TRACKS = ("compute", "comm")  # thread ids 0 and 1; any other track gets the next free id


def _thread_ids(events: list[TraceEvent]) -> dict[str, int]:
    tids = {track: tid for tid, track in enumerate(TRACKS)}
    for event in events:
        tids.setdefault(event.track, len(tids))
    return tids


def _metadata(pid: int, tid: int | None, name: str, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def chrome_trace(events: list[TraceEvent]) -> dict[str, Any]:
    """The trace as a JSON-ready dict: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Per rank that appears, metadata events name the process ``rank N`` and its threads
    ``compute`` and ``comm`` (both, even if one is empty) and sort ranks by number and compute
    above comm; then one complete event per :class:`TraceEvent`.
    """
    tids = _thread_ids(events)
    trace: list[dict[str, Any]] = []
    for rank in sorted({event.rank for event in events}):
        trace.append(_metadata(rank, None, "process_name", {"name": f"rank {rank}"}))
        trace.append(_metadata(rank, None, "process_sort_index", {"sort_index": rank}))
        for track, tid in tids.items():
            trace.append(_metadata(rank, tid, "thread_name", {"name": track}))
            trace.append(_metadata(rank, tid, "thread_sort_index", {"sort_index": tid}))
    for event in events:
        trace.append(
            {
                "ph": "X",
                "name": event.name,
                "cat": event.track,
                "pid": event.rank,
                "tid": tids[event.track],
                "ts": event.start_us,
                "dur": event.duration_us,
                "args": dict(event.args),
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: list[TraceEvent], path: str | os.PathLike[str]) -> None:
    """Write :func:`chrome_trace` of the events as JSON to ``path`` (parent folders created).
    Argument values JSON cannot hold (dtypes, tensors) are written as their ``str``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events), default=str, indent=None))
