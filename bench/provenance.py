"""What a benchmark result was measured on: the commit, its state, the releases and the machine.

Every figure in BENCHMARKS.md names the commit it measured; a result whose commit is older than
the code it describes says so there.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def source_commit() -> str:
    """The checkout's commit (short hash), ``-dirty`` when tracked files differ from it;
    ``unknown`` outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def provenance() -> dict[str, Any]:
    """The commit, the date, torch and Python releases, the CPU, its cores and its load."""
    import torch

    return {
        "commit": source_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
