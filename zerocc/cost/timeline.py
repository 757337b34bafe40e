"""Data the dumps draw: a memory timeline over a program and the timed events of a run.

Both the predicted side (``zerocc estimate``: liveness over the scheduled graph) and the
measured side (a real run) produce these, so plots and traces treat them alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Categories of live bytes, in the order plots stack them (``comm``: the process group's own
# buffers, see zerocc.cost.memory).
CATEGORIES = ("params", "grads", "optimizer", "gathered", "activations", "comm")


@dataclass
class MemoryTimeline:
    """Live bytes per category after each step of a program (one point per node)."""

    labels: list[str] = field(default_factory=list)  # what ran at each point (op and unit)
    phases: list[str] = field(default_factory=list)  # forward | backward | optimizer | ""
    series: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    host_peak: int = 0  # highest bytes of offload's host buffers (not in any device category)

    def append(self, label: str, phase: str, live: dict[str, int]) -> None:
        self.labels.append(label)
        self.phases.append(phase)
        for category in CATEGORIES:
            self.series[category].append(live.get(category, 0))
        self.host_peak = max(self.host_peak, live.get("host", 0))

    def totals(self) -> list[int]:
        return [sum(values) for values in zip(*self.series.values(), strict=True)]

    def peak(self) -> tuple[int, int]:
        """(index, bytes) of the highest total."""
        totals = self.totals()
        index = max(range(len(totals)), key=totals.__getitem__) if totals else 0
        return index, (totals[index] if totals else 0)


@dataclass(frozen=True)
class TraceEvent:
    """One op of an executed (or simulated) schedule, for a Chrome/Perfetto trace."""

    rank: int
    track: str  # "compute" | "comm" | "host" | a copy stream's (simulate.COPY_STREAMS, "nvme")
    name: str  # op name and unit, e.g. "all_gather transformer.h.0"
    start_us: float
    duration_us: float
    args: dict[str, Any] = field(default_factory=dict)  # e.g. {"bytes": 1234, "phase": ...}


EXPOSED = {"exposed": True}  # args of a compute-track event that is a blocking wait


def exposed_us(events: list[TraceEvent]) -> float:
    """Microseconds the compute track spent blocked in waits: the exposed communication."""
    return sum(e.duration_us for e in events if e.track == "compute" and e.args.get("exposed"))
