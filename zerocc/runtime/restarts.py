"""What a restart (``zerocc train --max-restarts``) tells: which rank was lost and how, and at the
end how many restarts there were and how many steps were trained twice.

torchrun's agent restarts the ranks inside the launcher's call, and tells nobody why. So the
launcher, while torchrun runs, records each attempt that fails before a restart
(:func:`losses_recorded`, on the agent's monitor): the failed ranks as its failure report says
them, and the furthest optimizer step any rank of the attempt reached (each rank notes its steps
as it goes, :class:`StepProgress`: one ``pwrite`` per step). The next attempt's rank 0 reads it
(:func:`lost_before`) for its restart line, notes where it starts again (:func:`note_resumed`),
and its summary counts the steps recomputed (:func:`restart_summary`). All of it lives in the
launch's run folder (``ZEROCC_RUN_DIR``); outside zerocc's launcher none of it is written.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "ZEROCC_RUN_DIR"  # (zerocc.runtime.launch's: the folder of the ranks' reports)
LOST = "lost.json"  # attempt -> {"ranks": [what became of each], "reached": step, "resumed": step}


def _run_dir() -> Path | None:
    folder = os.environ.get(RUN_DIR_ENV)
    return Path(folder) if folder else None


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class StepProgress:
    """This rank's optimizer steps so far, in a file of its attempt in the run folder, where the
    launcher reads them when the attempt fails (a restart's steps recomputed). Nothing outside
    zerocc's launcher."""

    def __init__(self) -> None:
        folder, rank = _run_dir(), os.environ.get("RANK")
        self._fd: int | None = None
        if folder is not None and rank is not None:
            path = folder / f"progress.attempt{_attempt()}.rank{rank}"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)

    def note(self, steps: int) -> None:
        """``steps`` optimizer steps are done (a fixed-width write in place: one syscall)."""
        if self._fd is not None:
            os.pwrite(self._fd, b"%20d" % steps, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _reached(folder: Path, attempt: int) -> int | None:
    """The furthest step any rank of ``attempt`` noted; None when none did."""
    steps = []
    for path in folder.glob(f"progress.attempt{attempt}.rank*"):
        with contextlib.suppress(OSError, ValueError):
            steps.append(int(path.read_bytes()))
    return max(steps, default=None)


def _read(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / LOST).read_text())
    except (OSError, ValueError):
        return {}


def _write(folder: Path, lost: dict[str, Any]) -> None:
    partial = folder / (LOST + ".tmp")
    partial.write_text(json.dumps(lost))
    partial.replace(folder / LOST)


@contextlib.contextmanager
def losses_recorded(
    run_dir: Path, describe: Callable[[dict[int, tuple[int, int]]], list[str]]
) -> Iterator[None]:
    """While the body runs torchrun: each attempt that fails with restarts left is recorded in
    ``run_dir`` (``describe``: the failed ranks, rank -> (exit code, pid), as lines of the
    failure report). It wraps the local agent's monitor (torch's ``_monitor_workers``, the one
    place the agent holds a failure it restarts from); on a torch without it, nothing is
    recorded and the restart lines say less."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import (
            LocalElasticAgent,
        )
    except ImportError:
        yield
        return
    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None:
        yield
        return

    def monitored(agent: Any, group: Any) -> Any:
        result = original(agent, group)
        with contextlib.suppress(Exception):  # (telling less never stops the run)
            if result.state.name in ("FAILED", "UNHEALTHY") and agent._remaining_restarts > 0:
                attempt = group.spec.max_restarts - agent._remaining_restarts
                failures = {r: (f.exitcode, f.pid) for r, f in result.failures.items()}
                lost = _read(run_dir)
                lost[str(attempt)] = {
                    "ranks": describe(failures),
                    "reached": _reached(run_dir, attempt),
                }
                _write(run_dir, lost)
        return result

    LocalElasticAgent._monitor_workers = monitored
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original


def lost_before(restart: int) -> str:
    """What ended the attempt before restart ``restart``, as its restart line says it
    (``rank 1 (pid 42): killed by SIGKILL: ...``); "" where the launcher recorded nothing (a
    rank lost on another machine, or outside zerocc's launcher)."""
    folder = _run_dir()
    if folder is None or restart < 1:
        return ""
    ranks = _read(folder).get(str(restart - 1), {}).get("ranks", [])
    return "; ".join(ranks)


def note_resumed(restart: int, steps: int) -> None:
    """Rank 0 of restart ``restart`` starts again at optimizer step ``steps``."""
    folder = _run_dir()
    if folder is None or restart < 1:
        return
    lost = _read(folder)
    lost.setdefault(str(restart - 1), {})["resumed"] = steps
    _write(folder, lost)


def restart_summary(restart: int) -> str | None:
    """``restarts: 2 (rank 1 lost twice); 5 step(s) recomputed``: how many restarts this launch
    made and the steps trained again after them (each failed attempt's furthest step past the
    step the next one started from); None before any restart."""
    if restart < 1:
        return None
    folder = _run_dir()
    attempts = _read(folder) if folder is not None else {}
    recomputed, known = 0, True
    for attempt in range(restart):
        entry = attempts.get(str(attempt), {})
        reached, resumed = entry.get("reached"), entry.get("resumed")
        if "ranks" not in entry:  # (the launcher recorded nothing of it)
            known = False
            continue
        if reached is None:  # (no rank of it finished a step: nothing to train again)
            continue
        if resumed is None:
            known = False
            continue
        recomputed += max(0, reached - resumed)
    steps = f"{recomputed} step(s) recomputed" if known else "the steps recomputed are unknown"
    if not known and recomputed:
        steps = f"at least {recomputed} step(s) recomputed"
    return f"restarts: {restart}; {steps} (trained again after the checkpoint each restart loaded)"
