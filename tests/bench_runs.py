"""A script of bench/ run end to end, as the benchmarks' smoke tests run one."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def bench_modules(*names: str) -> list[ModuleType]:
    """bench/'s modules ``names``, imported as its scripts import each other (bench/ first on
    ``sys.path``), then taken off the path and out of ``sys.modules`` again: their plain names
    (``kernels``, ``config``, ``compare``) would shadow installed packages of those names for
    the rest of the test process (transformers imports a ``kernels`` when one is found)."""
    before = set(sys.modules)
    sys.path.insert(0, str(BENCH))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(BENCH))
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(BENCH)):
                del sys.modules[name]
