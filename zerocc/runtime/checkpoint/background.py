"""Checkpoints written while training goes on: the step is blocked only while its state is
copied to host memory; a thread writes, hashes and commits the copy.

Between steps :meth:`BackgroundSaves.start` stages the rank's slices
(:func:`~zerocc.runtime.checkpoint.save.stage_checkpoint`) into host buffers kept from one save
to the next (pinned on CUDA, copied asynchronously and synced once), then hands them to a thread
that runs :func:`~zerocc.runtime.checkpoint.save.write_checkpoint`. The thread's agreement
travels on a gloo group of its own (:meth:`~zerocc.engine.comm.Comm.side_channel`), so that it
never meets the step's collectives on theirs.

One save is in flight at a time: the next one, a synchronous save, a load and the end of the
run wait for it first. The thread is not a daemon: a process that ends (even by an exception)
finishes the save it started before it exits. A rank killed mid-write leaves the staging folder
behind and the last committed checkpoint as it was (the commit is one rename, after every rank
wrote); one killed after rank 0 committed leaves that checkpoint whole, and the save's error
says so (:class:`~zerocc.runtime.checkpoint.save.SaveCommittedError`). A save that failed
raises its error where it is waited for.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerocc.runtime.checkpoint.save import (
    Piece,
    SaveCommittedError,
    StagedSave,
    rank_checkpoint_bytes,
    stage_checkpoint,
    write_checkpoint,
)
from zerocc.runtime.machine_memory import host_available

if TYPE_CHECKING:
    from zerocc.engine.comm import Comm
    from zerocc.runtime.checkpoint.checkpointed import Checkpointed

_ALIGN = 64  # bytes: each staged piece starts at a multiple (any dtype's view is aligned)


@dataclass
class SaveTimes:
    """How long a background save took: ``blocked_s`` the step waited (staging, and the
    previous save still in flight), ``written_s`` the thread wrote and committed."""

    blocked_s: float = 0.0
    written_s: float = 0.0


class PendingSave:
    """A checkpoint being written on a thread; :meth:`wait` gives its folder."""

    def __init__(self, staged: StagedSave, comm: Comm, times: SaveTimes) -> None:
        self.name, self.times = staged.name, times
        self._path: Path | None = None
        self._error: BaseException | None = None
        self.waited = False  # whether wait() gave its outcome (its folder or its error)
        self._thread = threading.Thread(
            target=self._write, args=(staged, comm), name=f"zerocc-save-{staged.name}"
        )
        self._thread.start()

    def _write(self, staged: StagedSave, comm: Comm) -> None:
        started = time.perf_counter()
        try:
            self._path = write_checkpoint(comm, staged)
        except BaseException as exc:  # raised where the save is waited for
            self._error = exc
            # (committed, a peer left after: the checkpoint is there, said as it is)
            how = ":" if isinstance(exc, SaveCommittedError) else " failed:"
            if comm.rank == 0:
                print(f"zerocc: the background save of {staged.name}{how} {exc}",
                      file=sys.stderr, flush=True)  # fmt: skip
        self.times.written_s = time.perf_counter() - started

    def done(self) -> bool:
        """Whether the thread has finished (committed, or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """The committed checkpoint's folder, once the thread has finished; the save's error
        (the same on every rank) if it failed."""
        self._thread.join()
        self.waited = True
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path


class BackgroundSaves:
    """A step's background saves: the host buffers they stage into, the side channel their
    agreements travel on, the save in flight."""

    def __init__(self, runner: Checkpointed) -> None:
        self.runner = runner
        self.pending: PendingSave | None = None
        self._buffer: torch.Tensor | None = None  # (bytes) the staged copies' storage
        self._comm: Comm | None = None

    def start(self, root: str | Path, keep: int | None) -> PendingSave:
        """Wait for the save in flight, stage this rank's slices into host memory and start
        writing them on a thread. Call on every rank, between steps."""
        started = time.perf_counter()
        self.wait()
        staged = stage_checkpoint(self.runner, root, keep)
        staged.pieces = self._copied(staged.pieces)
        if self._comm is None:  # (a collective: every rank's first background save)
            self._comm = self.runner.comm.side_channel()
        times = SaveTimes(blocked_s=time.perf_counter() - started)
        self.pending = PendingSave(staged, self._comm, times)
        return self.pending

    def wait(self) -> Path | None:
        """The folder of the save in flight once it is committed (its error if it failed);
        None when there is none, or its own ``wait()`` gave its outcome already."""
        pending, self.pending = self.pending, None
        if pending is None or pending.waited:
            return None
        return pending.wait()

    def _copied(self, pieces: list[Piece]) -> list[Piece]:
        """``pieces`` with their values copied into this rank's staging buffer: one host
        allocation (pinned on CUDA, where each pinned allocation is costly), made at the first
        save and reused after (the state's shapes do not change), each piece a view of it."""
        cuda = self.runner.device.type == "cuda"
        offsets, size = [], 0
        for piece in pieces:
            offsets.append(size)
            size += -(-piece.values.nbytes // _ALIGN) * _ALIGN
        if self._buffer is None or self._buffer.numel() != size:
            self._buffer = None  # (the old one goes before the new one is made)
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        staged = []
        for piece, at in zip(pieces, offsets, strict=True):
            values = piece.values
            view = self._buffer[at : at + values.nbytes].view(values.dtype).view(values.shape)
            view.copy_(values, non_blocking=cuda)
            staged.append(replace(piece, values=view))
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        return staged


def background_fits(runner: Checkpointed) -> tuple[bool, str]:
    """Whether every rank's staged copy fits in half the host memory it has available now
    (``checkpoint.async_save: auto``), agreed by every rank, and why not where it does not.
    Call on every rank at the same point."""
    need, room = rank_checkpoint_bytes(runner), host_available()
    everyone = runner.comm.all_gather_object((need, room))
    short = [(rank, n, r) for rank, (n, r) in enumerate(everyone) if 2 * n > r]
    if not short:
        return True, ""
    rank, need, room = short[0]
    return False, (
        f"a copy of rank {rank}'s state ({need / 2**30:.2f} GiB) is more than half the host "
        f"memory it has available ({room / 2**30:.2f} GiB)"
    )


class SavesInBackground:
    """What a step (:class:`zerocc.TrainStep`, under every plan) offers of
    background saves; its own ``save`` and ``load`` wait for the one in flight first."""

    def save_async(self: Checkpointed, folder: str | Path, keep: int | None = None) -> PendingSave:
        """Save as ``save`` does, but return once this rank's state is copied to host memory:
        a thread writes, hashes and commits it while training goes on. The returned save's
        ``wait()`` gives the checkpoint's folder (or raises its error); the next save, a load
        and the process's exit wait for it. Call on every rank, after a step."""
        return _background_saves(self).start(folder, keep)

    def wait_for_save(self: Checkpointed) -> Path | None:
        """The folder of the background save in flight, once committed (its error if it
        failed); None when none is in flight or its outcome was given (by its ``wait()``)."""
        saves = getattr(self, "_background_saves", None)
        return None if saves is None else saves.wait()


def _background_saves(runner: Checkpointed) -> BackgroundSaves:
    saves = getattr(runner, "_background_saves", None)
    if saves is None:
        saves = runner._background_saves = BackgroundSaves(runner)
    return saves
