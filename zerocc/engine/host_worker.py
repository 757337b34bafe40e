"""The host's worker: runs the host updates an offload defers (``stream=host``).

An offload that defers its updates (``offload.defer_updates``) issues a unit's host update and
goes on issuing the device's work; the program's ``host_wait`` for that update blocks until it
is done. On a GPU machine the updates run on one worker thread, in the order issued, beside the
thread that issues the device's work: the update kernels (torch's fused loops, the one-pass
loop) release the GIL while they run. On a CPU-only machine the same cores compute both, so
there is nothing to overlap: an update runs where it is issued, as the copy engine's copies do.

An update that raises re-raises at its ``host_wait``; :meth:`HostWorker.settle` waits out what
a failed run left running, so that nothing writes the states after the failure is reported.
The cores the host updates run on, a rank's share of the machine's, are
:func:`host_update_cores`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerocc.local_ranks import local_rank, ranks_on_this_machine


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


def host_update_cores() -> tuple[list[int], bool]:
    """The cores for the host updates of offloaded units on a GPU machine, and whether to pin
    this rank to them: its share of the cores it may run on, the ``LOCAL_RANK``-th slice, so
    the ranks of a machine (``LOCAL_WORLD_SIZE``) update on cores of their own. Pinned only when
    nothing restricted the process before (it may run on every core of the machine); a launcher
    or container that did keeps its set, and the rank takes its share of it in threads.
    Launchers set OMP_NUM_THREADS=1 for GPU ranks (torchrun does), which would leave the
    update, the one large CPU computation of the step, on a single core."""
    count = os.cpu_count() or 1
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = cores or list(range(count))
    share = max(1, len(cores) // ranks_on_this_machine(unknown=1))
    first = (local_rank() * share) % len(cores)
    return cores[first : first + share], len(cores) == count and hasattr(os, "sched_setaffinity")


def pin_host_update_threads() -> list[int]:
    """Give the host updates this rank's cores (:func:`host_update_cores`): torch's threads,
    one per core, and the process pinned to them where nothing restricted it before."""
    cores, pin = host_update_cores()
    if pin:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
