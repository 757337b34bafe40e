"""The watched wait (zerocc.engine.watchdog.wait_watched) on gloo: a send or receive whose peer
comes late is waited for, not failed after one slice; a silent peer still ends the wait."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks

from zerocc.engine.watchdog import WAIT_SLICE_S, PeersSilent, PeerState, wait_watched

LATE_S = 2.5 * WAIT_SLICE_S  # the peer's delay: more than two slices of the watched wait


def _late_peer(rank: int, world: int) -> dict[str, float]:
    """Rank 0 sends, then receives, waiting for each under the watch; rank 1 answers each
    LATE_S later. Returns what each rank holds after each transfer."""
    watch = SimpleNamespace(lost=[], silence_s=60.0)  # a watch that finds nobody silent
    held = {}
    for kind in ("send", "recv"):
        tensor = torch.full((1000,), float(rank + 1))
        if rank == 0:
            work = dist.isend(tensor, 1) if kind == "send" else dist.irecv(tensor, 1)
            wait_watched(work, watch, point_to_point=True)
        else:
            time.sleep(LATE_S)
            dist.recv(tensor, 0) if kind == "send" else dist.send(tensor, 0)
        held[kind] = tensor[0].item()
    return held


def test_a_gloo_send_or_receive_waits_for_a_peer_that_comes_late():
    # A timed gloo wait on a send or receive closes the pair when it runs out: waited in
    # slices, a peer one slice late failed the run ("Timed out waiting 1000ms for send").
    first, second = run_ranks(2, _late_peer, timeout=120)
    assert first == second == {"send": 1.0, "recv": 2.0}


class _NeverDone:
    """A work handle whose wait blocks until released (a peer that never answers)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def wait(self, timeout=None) -> bool:  # noqa: ANN001
        self.released.wait()
        return True


def test_a_point_to_point_wait_ends_once_the_watch_names_a_silent_peer():
    watch = SimpleNamespace(lost=[], silence_s=60.0)
    work = _NeverDone()
    threading.Timer(0.5, lambda: watch.lost.append(PeerState(1, answering=False))).start()
    start = time.monotonic()
    with pytest.raises(PeersSilent):
        wait_watched(work, watch, point_to_point=True)
    assert time.monotonic() - start < 0.5 + 2 * WAIT_SLICE_S
    work.released.set()
