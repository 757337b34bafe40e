"""Plot a memory timeline as a PNG: live bytes per category over the program, stacked.

Drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas, so plotting touches neither
pyplot's global state nor the user's display backend.
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text

from zerocc.cost.timeline import CATEGORIES, MemoryTimeline
from zerocc.ir.quantities import human_bytes

# One colour per category (colour-blind friendly, the order of CATEGORIES).
CATEGORY_COLORS = {
    "params": "#4c72b0",
    "grads": "#dd8452",
    "optimizer": "#55a868",
    "gathered": "#c44e52",
    "activations": "#8172b3",
    "comm": "#937860",
}
PHASE_COLORS = {"forward": "#d6eaf8", "backward": "#d5f5e3", "optimizer": "#fcf3cf"}
_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def _unit_for(peak: int) -> tuple[str, int]:
    """The largest binary unit in which the peak is at least 1 (MiB for 3 MiB, not GiB)."""
    return next(((name, size) for name, size in _UNITS if peak >= size), ("B", 1))


def _phase_runs(phases: list[str]) -> list[tuple[str, int, int]]:
    """(phase, first index, last index) of each maximal run of equal phases."""
    runs: list[tuple[str, int, int]] = []
    for index, phase in enumerate(phases):
        if runs and runs[-1][0] == phase:
            runs[-1] = (phase, runs[-1][1], index)
        else:
            runs.append((phase, index, index))
    return runs


def _shade_phases(ax: Axes, phases: list[str]) -> list[Patch]:
    """Shade each run of a phase; returns a legend entry per phase present."""
    present = []
    for phase, first, last in _phase_runs(phases):
        if phase not in PHASE_COLORS:
            continue
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLORS[phase], alpha=0.6, zorder=0)
        present += [phase] if phase not in present else []
    return [Patch(color=PHASE_COLORS[p], alpha=0.6, label=f"{p} phase") for p in present]


def _name_phases(ax: Axes, phases: list[str]) -> list[Text]:
    """Name each phase once, inside the top of its widest run, where the name fits in the run
    (the legend names them all): names of narrow or alternating runs (recomputed forwards in
    backward, a short optimizer phase) would overlap each other or run past the axes. Call
    once the figure's layout is final."""
    renderer = ax.figure.canvas.get_renderer()
    widest: dict[str, tuple[int, int]] = {}
    for phase, first, last in _phase_runs(phases):
        if phase in PHASE_COLORS and last - first >= _width(widest.get(phase)):
            widest[phase] = (first, last)
    names = []
    for phase, (first, last) in widest.items():
        at = ((first + last) / 2, 0.98)
        name = ax.text(*at, phase, transform=ax.get_xaxis_transform(), ha="center", va="top",
                       fontsize=8, color="#566573", clip_on=True)  # fmt: skip
        left, right = ax.transData.transform([(first - 0.5, 0), (last + 0.5, 0)])[:, 0]
        if name.get_window_extent(renderer).width > right - left:
            name.remove()
        else:
            names.append(name)
    return names


def _width(run: tuple[int, int] | None) -> int:
    return -1 if run is None else run[1] - run[0]


def _mark_peak(
    ax: Axes, x: float, peak: int, label: str, scale: int, color: str, side: str, name: str
) -> None:
    """A dot on the peak and, above it to the ``side`` ("left" or "right"), its size and op."""
    short = label if len(label) <= 48 else label[:45] + "..."
    ax.plot([x], [peak / scale], "o", color=color, zorder=5)
    ax.annotate(
        f"{name} {human_bytes(peak)}\n{short}",
        xy=(x, peak / scale),
        xytext=(15 if side == "right" else -15, 18),
        textcoords="offset points",
        ha="left" if side == "right" else "right",
        fontsize=8,
        color=color,
        arrowprops={"arrowstyle": "-", "color": color},
        bbox={"boxstyle": "round", "fc": "white", "ec": color, "alpha": 0.9},
        zorder=6,
    )


def plot_memory(
    path: str | os.PathLike[str],
    predicted: MemoryTimeline,
    measured: MemoryTimeline | None = None,
    title: str = "",
) -> Figure:
    """Write a PNG of the predicted timeline: a stacked area per category (params at the
    bottom), the forward/backward/optimizer regions shaded, the peak marked and labelled.

    ``measured``, when given, is drawn as its total in a black line on the same axes. It may
    have a different number of points than ``predicted``: point ``i`` of ``m`` is placed at
    ``i * (n - 1) / (m - 1)`` of the predicted ``n`` op positions, so both span the same
    program. Its peak is marked too. The y unit (B/KiB/MiB/GiB) follows the larger peak.
    Returns the figure written.
    """
    figure = Figure(figsize=(10, 5), dpi=120)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    n = len(predicted.labels)
    x = list(range(n))
    peak_index, peak = predicted.peak()
    measured_peak = measured.peak() if measured is not None and measured.labels else None
    unit, scale = _unit_for(max(peak, measured_peak[1] if measured_peak else 0))

    phase_patches = _shade_phases(ax, predicted.phases)
    if n:
        ax.stackplot(
            x,
            *[[b / scale for b in predicted.series[c]] for c in CATEGORIES],
            labels=list(CATEGORIES),
            colors=[CATEGORY_COLORS[c] for c in CATEGORIES],
            alpha=0.85,
            zorder=2,
        )
        # Labels point away from each other (and from the right edge), so the two never overlap.
        if measured_peak is not None and len(measured.labels) > 1:
            measured_x = measured_peak[0] * (n - 1) / (len(measured.labels) - 1)
            side = "left" if measured_x >= peak_index else "right"
        else:
            side = "right" if peak_index < 0.6 * n else "left"
        label = predicted.labels[peak_index]
        name = "peak" if measured_peak is None else "predicted peak"
        _mark_peak(ax, peak_index, peak, label, scale, "#c0392b", side, name)
    if measured is not None and measured_peak is not None:
        m = len(measured.labels)
        stretch = (n - 1) / (m - 1) if m > 1 and n > 1 else 1.0
        xs = [i * stretch for i in range(m)]
        totals = [b / scale for b in measured.totals()]
        ax.plot(xs, totals, color="black", lw=1.5, zorder=4, label="measured total")
        index, value = measured_peak
        other = "left" if n and side == "right" else "right"
        label = measured.labels[index]
        _mark_peak(ax, xs[index], value, label, scale, "black", other, "measured peak")
    if not n:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")

    ax.set_title(title or "memory per rank")
    ax.set_xlabel("program position (op index)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_ylim(0, max(peak, measured_peak[1] if measured_peak else 0) / scale * 1.3 or 1)
    ax.grid(axis="y", alpha=0.3)
    if n:
        handles, labels = ax.get_legend_handles_labels()
        handles = [*handles[::-1], *phase_patches]
        labels = [*labels[::-1], *(patch.get_label() for patch in phase_patches)]
        # Outside the axes, on the right, so it never hides the phases' names or the peaks.
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    figure.tight_layout()
    _name_phases(ax, predicted.phases)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return figure
