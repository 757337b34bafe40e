"""Quantities as people read them: byte counts and durations (no torch: the command line
prints them before it imports any)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``12.0MiB``-style byte counts."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def human_seconds(seconds: float) -> str:
    """``1.23 s``, ``45.6 ms`` or ``789 us``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"
