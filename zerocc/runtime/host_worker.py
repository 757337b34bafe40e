"""The host's worker: runs the host updates a pipelined program issues (``stream=host``).

A pipelined offload (``offload.pipeline``) issues a unit's host update and goes on issuing the
device's work; the program's ``host_wait`` for that update blocks until it is done. On a GPU
machine the updates run on one worker thread, in the order issued, beside the thread that
issues the device's work: the update kernels (torch's fused loops, the one-pass loop) release
the GIL while they run. On a CPU-only machine the same cores compute both, so there is nothing
to overlap: an update runs where it is issued, as the copy engine's copies do.

An update that raises re-raises at its ``host_wait``; :meth:`HostWorker.settle` waits out what
a failed run left running, so that nothing writes the states after the failure is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class HostWork:
    """The handle of one issued host update."""

    def __init__(self, future: Future | None = None) -> None:
        self._future = future

    def wait(self) -> None:
        """Block until the update is done; re-raises what it raised."""
        if self._future is not None:
            self._future.result()


class HostWorker:
    """Runs host updates in the order issued: on a thread of its own when ``threaded``, else
    where they are issued."""

    def __init__(self, threaded: bool = False) -> None:
        self.threaded = threaded
        self._pool: ThreadPoolExecutor | None = None
        self._issued: list[Future] = []

    def submit(self, work: Callable[[], Any]) -> HostWork:
        """Issue ``work``; its handle's ``wait`` returns once it is done."""
        if not self.threaded:
            work()
            return HostWork()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerocc-host")
        future = self._pool.submit(work)
        self._issued = [f for f in self._issued if not f.done()] + [future]
        return HostWork(future)

    def settle(self) -> None:
        """Wait for every update issued so far, whatever it raised (the run that issued them
        failed already, and says why)."""
        issued, self._issued = self._issued, []
        for future in issued:
            future.exception()
