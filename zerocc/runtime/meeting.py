"""What a launcher of a run over several machines says while its machine waits for the others:
torchrun's rendezvous waits in silence (its static one up to 10 minutes, its c10d one up to its
join timeout), and a machine started with a wrong ``--node-rank`` or ``--rdzv-endpoint``, or
whose peers never started, would look hung.

The launcher watches its own child processes (the ranks torchrun starts): while it has none
for :data:`WAIT_NOTICE_S` seconds, it waits at the rendezvous, and says so, once per wait and
then every :data:`WAIT_REPEAT_S` seconds with the time waited.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

WAIT_NOTICE_S = 10.0  # seconds without a rank before the first notice
WAIT_REPEAT_S = 60.0  # seconds between notices of one wait


def has_children(pid: int | None = None) -> bool:
    """Whether process ``pid`` (this one by default) has a child that is not a zombie (Linux:
    read from /proc)."""
    parent = os.getpid() if pid is None else pid
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # (a process gone meanwhile)
        if int(ppid) == parent and state != "Z":
            return True
    return False


class WaitNotices:
    """While running, prints to stderr when this process has had no child for a while: the
    first wait as waiting for the run's other machines (``first``), later ones (after its ranks
    ended: a restart) as waiting for them to meet again (``again``)."""

    def __init__(self, first: str, again: str, poll_s: float = 1.0) -> None:
        self.first, self.again, self.poll_s = first, again, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerocc-wait-notice", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        had_ranks, since, said = False, time.monotonic(), 0.0
        while not self._stop.wait(self.poll_s):
            if has_children():
                had_ranks, since, said = True, time.monotonic(), 0.0
                continue
            waited = time.monotonic() - since
            due = WAIT_NOTICE_S if not said else said + WAIT_REPEAT_S
            if waited >= due:
                what = self.again if had_ranks else self.first
                print(f"zerocc: {what}; {waited:.0f} s so far", file=sys.stderr, flush=True)
                said = waited

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
