"""A script of bench/ run end to end, as the benchmarks' smoke tests run one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench"


def run_bench(
    script: str, *args: object, exit_code: int | tuple[int, ...] = 0, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``bench/<script>`` with ``args`` in a process of its own; fail, with the ends of
    its output, unless it exits with ``exit_code`` (or one of them)."""
    command = [sys.executable, str(BENCH / script), *map(str, args)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    allowed = exit_code if isinstance(exit_code, tuple) else (exit_code,)
    assert run.returncode in allowed, run.stdout[-3000:] + run.stderr[-3000:]
    return run
