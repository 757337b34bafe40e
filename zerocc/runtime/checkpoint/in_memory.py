"""Checkpoints in memory (``checkpoint.in_memory``): after every step each rank keeps its own
state in its machine's shared memory and, over several machines, a copy on a rank of the next
machine, so that a restart loses no step and reads no disk, even when a whole machine is lost.

A snapshot is one rank's state as ``step.state_dict()`` gives it (its shards, optimizer state,
counters and loss scale) with its random number generators: what that rank needs to go on
under the same plan and world size. (A run that goes on with fewer ranks loads the disk
checkpoint, which reshards.) It is a file of the machine's folder in ``/dev/shm``
(:mod:`.snapshot_file`: raw bytes copied into its pages), named by step, rank and world size
and written by a rename, so a file seen is whole; the same bytes go to the peer, which
receives them straight into its file.

**Saving.** Each rank writes its own snapshot, sends it to the rank ``ranks per machine``
further round the ring (the same local rank of the next machine), keeps the one it receives
from the rank as far behind, and once every rank has both, the older step's files go: a
machine lost mid-save leaves the step before whole on the others.

**Restoring.** The ranks tell each other what their machine's folder holds, and the newest
step whose every rank's snapshot is held somewhere is loaded: each rank reads its own from its
machine's memory, or receives it from a rank that holds it (a machine that replaced a lost
one holds nothing; its ranks' snapshots come from the copies on the next machine). A snapshot
goes by the rank whose state it is, wherever that rank runs after the restart (torchrun's c10d
rendezvous numbers the machines as they join).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerocc.engine.failures import peer_failure
from zerocc.runtime.checkpoint.agreement import agree, attempt, gathered
from zerocc.runtime.checkpoint.files import CheckpointError
from zerocc.runtime.checkpoint.snapshot_file import (
    emptied,
    partial_path,
    read_snapshot,
    write_snapshot,
)

if TYPE_CHECKING:
    from zerocc.engine.comm import Comm

KEPT = "the step before stays in memory"
_RNG = "rng/"  # a snapshot's tensors named so are its random number generators' states
_NAME = re.compile(r"step-(\d+)\.rank-(\d+)-of-(\d+)\.snapshot")


def snapshot_name(step: int, rank: int, world_size: int) -> str:
    return f"step-{step:08d}.rank-{rank:05d}-of-{world_size:05d}.snapshot"


@dataclass(frozen=True)
class Held:
    """A snapshot a machine's folder holds: rank ``rank``'s state after step ``step`` of a
    run of ``world_size`` ranks, ``nbytes`` long."""

    step: int
    rank: int
    world_size: int
    nbytes: int


class MemoryCheckpoints:
    """The snapshots of one rank's machine (``folder``, shared by its ranks) and the ring of
    copies between machines of ``ranks_per_machine`` ranks each (none on one machine)."""

    def __init__(self, folder: Path, comm: Comm, ranks_per_machine: int) -> None:
        self.folder, self.comm = folder, comm
        rank, world = comm.rank, comm.world_size
        copies = world > ranks_per_machine and world % ranks_per_machine == 0
        self.copy_to = (rank + ranks_per_machine) % world if copies else None
        self.copy_from = (rank - ranks_per_machine) % world if copies else None
        self.saved_s = 0.0  # seconds the saves took, all told

    def save(self, step) -> None:
        """Snapshot ``step`` (every rank, after an optimizer step): this rank's own file, its
        copy on the next machine and the copy it keeps of the previous one's; then the older
        step's files go. Any rank's failure fails it on every rank (CheckpointError), a peer
        gone mid-copy is a RankStoppedError."""
        started = time.perf_counter()
        done = step.micro_batches // step.plan.grad_accumulation
        rank, world = self.comm.rank, self.comm.world_size
        mine = self.folder / snapshot_name(done, rank, world)
        error = attempt(lambda: _write(mine, step, done))
        if self.copy_to is not None and self.copy_from is not None:
            theirs = self.folder / snapshot_name(done, self.copy_from, world)
            error = self._swap(mine if error is None else None, theirs) or error
        agree(self.comm, error, "save to memory", KEPT)
        for held in self.held():
            if held.step < done:
                (self.folder / snapshot_name(held.step, held.rank, held.world_size)).unlink(
                    missing_ok=True  # (the machine's other ranks clear the same files)
                )
        self.saved_s += time.perf_counter() - started

    def held(self) -> list[Held]:
        """The snapshots this machine's folder holds."""
        found = []
        for file in self.folder.glob("*.snapshot") if self.folder.is_dir() else []:
            if match := _NAME.fullmatch(file.name):
                try:
                    nbytes = file.stat().st_size
                except FileNotFoundError:  # (cleared by another rank of the machine meanwhile)
                    continue
                step, rank, world = map(int, match.groups())
                found.append(Held(step, rank, world, nbytes))
        return found

    def newest(self) -> tuple[int | None, list[list[Held]]]:
        """The newest step whose every rank's snapshot some machine holds (None: none), and
        what each rank's machine holds (a collective: every rank calls it)."""
        world = self.comm.world_size
        everyone = gathered(self.comm, self.held(), "look in memory")
        ranks_by_step: dict[int, set[int]] = {}
        for holds in everyone:
            for held in holds:
                if held.world_size == world:
                    ranks_by_step.setdefault(held.step, set()).add(held.rank)
        whole = [s for s, ranks in ranks_by_step.items() if len(ranks) == world]
        return max(whole, default=None), everyone

    def restore(self, step, done: int, everyone: list[list[Held]]) -> int:
        """Load the snapshots of step ``done`` into ``step`` on every rank, each rank's from
        its machine's folder or, where that lacks it, received from the first rank holding
        it (``everyone``: what :meth:`newest` gathered). Returns how many ranks received
        theirs from a peer."""
        rank, world = self.comm.rank, self.comm.world_size
        sources = {}
        for wanted in range(world):
            holders = [r for r, holds in enumerate(everyone) if _holds(holds, done, wanted, world)]
            if wanted not in holders:
                sources[wanted] = holders[0]
        mine = self.folder / snapshot_name(done, rank, world)
        sends = {
            wanted: _mapped(self.folder / snapshot_name(done, wanted, world))
            for wanted, source in sources.items()
            if source == rank
        }
        receives, error = {}, None
        if rank in sources:
            nbytes = next(
                h.nbytes
                for h in everyone[sources[rank]]
                if (h.step, h.rank, h.world_size) == (done, rank, world)
            )
            receives[sources[rank]], error = _receiving(mine, nbytes)
        self._exchange(sends, receives, "the restore from a peer's memory")
        if receives and error is None:
            partial_path(mine).replace(mine)
        loaded = error or attempt(lambda: _load(step, mine, done))
        agree(self.comm, loaded, "restore from memory", "nothing was loaded")
        return len(sources)

    def _swap(self, mine: Path | None, theirs: Path) -> str | None:
        """Send this rank's snapshot ``mine`` (None where it could not be written: nothing
        goes) to the next machine's rank and receive the previous machine's into ``theirs``;
        the error keeping it, or None."""
        assert self.copy_to is not None and self.copy_from is not None
        sent = _mapped(mine) if mine is not None else torch.empty(0, dtype=torch.uint8)
        size = torch.zeros(1, dtype=torch.int64)
        self._exchange({self.copy_to: torch.tensor([sent.numel()])}, {self.copy_from: size},
                       "the copy to a peer")  # fmt: skip
        into, error = _receiving(theirs, int(size))
        self._exchange(
            {self.copy_to: sent} if sent.numel() else {},
            {self.copy_from: into} if into.numel() else {},
            "the copy to a peer",
        )
        if error is None and into.numel():
            partial_path(theirs).replace(theirs)
        return error

    def _exchange(self, sends: dict, receives: dict, what: str) -> None:
        try:
            self.comm.send_receive(sends, receives)
        except Exception as exc:
            raise peer_failure(self.comm, exc, f"the in-memory checkpoint's {what}") from exc


def _holds(holds: list[Held], step: int, rank: int, world: int) -> bool:
    return any((h.step, h.rank, h.world_size) == (step, rank, world) for h in holds)


def _receiving(path: Path, nbytes: int) -> tuple[torch.Tensor, str | None]:
    """Where ``nbytes`` for file ``path`` are received: its partial file's pages, or where that
    cannot be made a buffer of its own (the bytes must still be taken off the wire), with the
    error."""
    partial = partial_path(path)
    error = attempt(lambda: emptied(partial))
    if error is not None or not nbytes:
        return torch.empty(nbytes, dtype=torch.uint8), error
    return _mapped(partial, nbytes, shared=True), None


def _mapped(path: Path, nbytes: int | None = None, shared: bool = False) -> torch.Tensor:
    """The bytes of file ``path`` as a uint8 tensor over its pages (no copy): read, or with
    ``shared`` written through to the file (grown to ``nbytes``)."""
    size = path.stat().st_size if nbytes is None else nbytes
    return torch.from_file(str(path), shared=shared, size=size, dtype=torch.uint8)


def _write(path: Path, step, done: int) -> None:
    """This rank's snapshot of ``step`` after step ``done``: its state dict's tensors and its
    random number generators', its counters in the header."""
    sd = step.state_dict()
    tensors = {k: t for k, t in sd.items() if isinstance(t, torch.Tensor)}
    tensors[_RNG + "cpu"] = torch.get_rng_state()
    if step.device.type == "cuda":
        tensors[_RNG + "cuda"] = torch.cuda.get_rng_state(step.device)
    write_snapshot(path, tensors, {"step": done, "rank": step.comm.rank, "zerocc": sd["zerocc"]})


def _load(step, path: Path, done: int) -> None:
    tensors, meta = read_snapshot(path)
    if (meta["step"], meta["rank"]) != (done, step.comm.rank):
        raise CheckpointError(
            f"{path} holds rank {meta['rank']}'s state after step {meta['step']}, not rank "
            f"{step.comm.rank}'s after step {done}"
        )
    rng = {k.removeprefix(_RNG): tensors.pop(k) for k in list(tensors) if k.startswith(_RNG)}
    step.load_state_dict({**tensors, "zerocc": meta["zerocc"]})
    torch.set_rng_state(rng["cpu"].clone())
    if "cuda" in rng and step.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].clone(), step.device)
