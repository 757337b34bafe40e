"""Checkpoints in memory (``checkpoint.in_memory``): after every step each rank keeps its own
state in its machine's shared memory and, over several machines, a copy on a rank of the next
machine, so that a restart loses no step and reads no disk (at most one when a whole machine
is lost: see Saving).

A snapshot is one rank's state as ``step.state_dict()`` gives it (its shards, optimizer state,
counters and loss scale) with its random number generators: what that rank needs to go on
under the same plan and world size. A run that goes on with another number of ranks writes
the snapshots out as a disk checkpoint, which reshards (see Writing out). It is a file of
the machine's folder in ``/dev/shm`` (:mod:`.snapshot_file`: raw bytes copied into its pages),
named by step, rank and world size and written by a rename, so a file seen is whole; the same
bytes go to the peer, which receives them straight into its file.

**Saving.** Each rank writes its own snapshot, sends it to the rank ``ranks per machine``
further round the ring (the same local rank of the next machine), keeps the one it receives
from the rank as far behind, and once every rank has both, the older step's files go: a
machine lost mid-save leaves the step before whole on the others. The copies travel on a
thread, on a gloo group of their own (:meth:`~zerocc.engine.comm.Comm.side_channel`), while
the next step trains; the next save waits for them first. A machine lost while they travel
loses that step too: the restart takes the step before, which the thread had made whole.

Each rank keeps the files it wrote and received mapped, and the step before's (own and copy)
as spares that the next save renames and writes into: a step's snapshot then takes no new
pages, at memory speed (4× a new file's), for two snapshots and two copies held between saves
instead of one each (what a save held at its peak before).

**Restoring.** The ranks tell each other what their machine's folder holds, and the newest
step whose every rank's snapshot is held somewhere is loaded: each rank reads its own from its
machine's memory, or receives it from a rank that holds it (a machine that replaced a lost
one holds nothing; its ranks' snapshots come from the copies on the next machine). A snapshot
goes by the rank whose state it is, wherever that rank runs after the restart (torchrun's c10d
rendezvous numbers the machines as they join).

**Writing out.** Where the newest whole step is of another number of ranks (a machine lost
that nobody replaces, one more, ``--nproc-min``'s fewer ranks), a rank holding each snapshot
writes it as that rank's file of a disk checkpoint (:meth:`MemoryCheckpoints.write_out`):
each snapshot records where the slices its rank's disk save writes lie in its tensors
(:func:`~zerocc.runtime.checkpoint.save.state_slices`), and rank 0's the run's metadata, so
the checkpoint is the one those ranks would have saved, and it loads resharded.
"""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerocc.engine.failures import peer_failure
from zerocc.ir.quantities import human_bytes
from zerocc.runtime.checkpoint.agreement import agree, attempt, gathered, raise_errors
from zerocc.runtime.checkpoint.files import CheckpointError, checkpoint_name
from zerocc.runtime.checkpoint.save import (
    Piece,
    Slice,
    pieces_of,
    rng_pieces,
    rng_states,
    run_metadata,
    state_slices,
    write_files,
)
from zerocc.runtime.checkpoint.snapshot_file import (
    MappedFile,
    mapped_for,
    partial_path,
    read_snapshot,
    write_snapshot,
)
from zerocc.runtime.machine_memory import host_available

if TYPE_CHECKING:
    from zerocc.engine.comm import Comm

KEPT = "the step before stays in memory"
ABANDON_GRACE_S = 5.0  # seconds the copies in flight get once the run failed (abandon)
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
    copies between machines of ``ranks_per_machine`` ranks each (none on one machine). Made
    on every rank at the same point (over several machines it makes a process group)."""

    def __init__(self, folder: Path, comm: Comm, ranks_per_machine: int) -> None:
        self.folder, self.comm, self.ranks_per_machine = folder, comm, ranks_per_machine
        rank, world = comm.rank, comm.world_size
        copies = world > ranks_per_machine and world % ranks_per_machine == 0
        self.copy_to = (rank + ranks_per_machine) % world if copies else None
        self.copy_from = (rank - ranks_per_machine) % world if copies else None
        # The ranks whose files this machine's ranks look after: their own, and the copies
        # they keep (the machine's ranks are consecutive: torchrun numbers them node-major).
        first = rank - rank % ranks_per_machine if copies else 0
        self.machine_ranks = range(first, first + ranks_per_machine) if copies else range(world)
        self.looked_after = {
            *self.machine_ranks,
            *((r - ranks_per_machine) % world for r in self.machine_ranks if copies),
        }
        self.saved_s = 0.0  # seconds the saves kept training waiting, all told
        self.copied_s = 0.0  # seconds the copies took on their thread, all told
        # The side channel the copies travel on (making it is a collective: every rank makes
        # its MemoryCheckpoints at the same point)
        self._copies = comm.side_channel() if copies else None
        self._copying: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        # This rank's newest files (its own snapshot, the copy it keeps) and the older ones
        # kept to be written into next, all mapped; by kind ("own", "copy").
        self.newest_files: dict[str, MappedFile] = {}
        self.spares: dict[str, MappedFile] = {}
        # What a snapshot records to be written out as a checkpoint (write_out), taken at
        # the first save: this rank's slices, and on rank 0 the run's metadata.
        self._slices: list[Slice] | None = None
        self._run: dict | None = None
        for kind in ("own", "copy"):  # (an earlier attempt's, unmapped: no use)
            self._spare_path(kind, rank).unlink(missing_ok=True)

    def save(self, step) -> None:
        """Snapshot ``step`` (every rank, after an optimizer step): this rank's own file, its
        copy on the next machine and the copy it keeps of the previous one's; then the older
        step's files go. Over several machines the copies and what follows them run on a
        thread (:meth:`wait`); the previous step's are waited for first. Any rank's failure
        fails it on every rank (CheckpointError), a peer gone mid-copy is a RankStoppedError,
        raised here or, from the thread, where it is waited for."""
        started = time.perf_counter()
        self.wait()
        done = step.micro_batches // step.plan.grad_accumulation
        mine = self.folder / snapshot_name(done, self.comm.rank, self.comm.world_size)
        written: dict[str, MappedFile] = {}
        first = self._slices is None
        if first:
            self._slices = state_slices(step)
            self._run = run_metadata(step) if self.comm.rank == 0 else None

        def write() -> None:
            tensors, meta = _snapshot(step, done, self._slices, self._run)
            if first:
                self._check_room(sum(t.nbytes for t in tensors.values()))
            written["own"] = write_snapshot(mine, tensors, meta, self.spares.pop("own", None))

        error = attempt(write)
        if self.copy_to is None:
            agree(self.comm, error, "save to memory", KEPT)
            self._settle(done, written)
        else:
            mine_or_none = mine if error is None else None
            self._copying = threading.Thread(
                target=self._copy, args=(done, mine_or_none, written, error),
                name=f"zerocc-memory-copy-{done}", daemon=True,  # (see abandon)
            )  # fmt: skip
            self._copying.start()
        self.saved_s += time.perf_counter() - started

    def _check_room(self, nbytes: int) -> None:
        """That the snapshots this machine's ranks keep fit in its memory, each rank's
        ``nbytes`` as this one's (a tmpfs written past its size kills the writer by SIGBUS;
        host memory short, the out-of-memory killer does): CheckpointError naming what they
        need and what the machine has, which the save's agreement tells every rank. At the
        first save, before anything is written."""
        ranks = min(self.ranks_per_machine, self.comm.world_size)
        check_room(nbytes, ranks, self.copy_to is not None, _room(self.folder), self.folder.parent,
                   "and host memory")  # fmt: skip

    def wait(self) -> None:
        """Wait for the copies in flight (and the agreement after them); their error, if they
        failed, is raised here. Call before the process groups close."""
        thread, self._copying = self._copying, None
        if thread is None:
            return
        thread.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise error

    def abandon(self, grace_s: float = ABANDON_GRACE_S) -> None:
        """On the way out after an error: give the copies in flight ``grace_s`` seconds, then
        leave them to end with the process (a daemon thread). A peer that is gone may never
        answer its half of the exchange (seen once after a lost machine, cause not found: gloo
        fails it only at the collective timeout, 10 minutes by default), and the rank would
        not end until then: torchrun restarts nobody meanwhile. Their step is not whole
        anywhere; a restart takes an earlier one."""
        thread, self._copying = self._copying, None
        if thread is not None:
            thread.join(grace_s)

    def _copy(
        self, done: int, mine: Path | None, written: dict[str, MappedFile], error: str | None
    ) -> None:
        """The thread of a save over several machines: swap the copies, agree, settle."""
        started = time.perf_counter()
        assert self._copies is not None and self.copy_from is not None
        try:
            theirs = self.folder / snapshot_name(done, self.copy_from, self.comm.world_size)
            received, swap_error = self._swap(self._copies, mine, theirs)
            if received is not None:
                written["copy"] = received
            agree(self._copies, swap_error or error, "save to memory", KEPT)
            self._settle(done, written)
        except BaseException as exc:  # raised where the save is waited for
            self._copy_error = exc
        self.copied_s += time.perf_counter() - started

    def _settle(self, done: int, written: dict[str, MappedFile]) -> None:
        """Once step ``done`` is whole everywhere: its files are the newest, the ones they
        replace become spares, and the older step's go."""
        for kind, file in written.items():
            if (older := self.newest_files.get(kind)) is not None:
                self._keep_spare(kind, older)
            self.newest_files[kind] = file
        self._clear_before(done)

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

    def newest(self) -> tuple[int | None, int, list[list[Held]]]:
        """The newest step whose every rank's snapshot some machine holds (None: none), the
        number of ranks of the run that took it (this run's where two are as new: another
        number's is written out before it loads, :meth:`write_out`), and what each rank's
        machine holds (a collective: every rank calls it)."""
        everyone = gathered(self.comm, self.held(), "look in memory")
        ranks_by_step: dict[tuple[int, int], set[int]] = {}
        for holds in everyone:
            for held in holds:
                ranks_by_step.setdefault((held.step, held.world_size), set()).add(held.rank)
        whole = [taken for taken, ranks in ranks_by_step.items() if len(ranks) == taken[1]]
        if not whole:
            return None, self.comm.world_size, everyone
        done, world = max(whole, key=lambda t: (t[0], t[1] == self.comm.world_size))
        return done, world, everyone

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
            pages, error = _receiving(mine, nbytes)
            receives[sources[rank]] = pages[:nbytes]
        _exchange(self.comm, sends, receives, "the restore from a peer's memory")
        if receives and error is None:
            partial_path(mine).replace(mine)
        loaded = error or attempt(lambda: _load(step, mine, done))
        agree(self.comm, loaded, "restore from memory", "nothing was loaded")
        return len(sources)

    def write_out(
        self, done: int, world: int, everyone: list[list[Held]], root: Path, keep: int | None
    ) -> Path:
        """Write the snapshots of step ``done`` of a run of ``world`` ranks (a number other
        than this run's: a machine lost, or one more) as checkpoint ``step-<done>`` under
        ``root``, which loads resharded under this run's ranks; its folder. Each rank's
        snapshot is written by one rank whose machine holds it, spread over them, from the
        slices the snapshot records (``everyone``: what :meth:`newest` gathered). A collective;
        a rank's failure fails it on every rank (CheckpointError, nothing committed)."""
        writers = {}
        for old in range(world):
            holders = [r for r, holds in enumerate(everyone) if _holds(holds, done, old, world)]
            writers[old] = holders[old % len(holders)]
        files: dict[int, list[Piece]] = {}
        run: dict = {}  # (the checkpoint's metadata, from rank 0's snapshot)

        def read() -> None:
            for saved_by in (r for r, writer in writers.items() if writer == self.comm.rank):
                path = self.folder / snapshot_name(done, saved_by, world)
                tensors, meta = read_snapshot(path)
                files[saved_by] = _checkpoint_pieces(path, tensors, meta)
                if saved_by == 0:
                    run.update(_run_of(meta, done))

        found = gathered(self.comm, (attempt(read), run), "read of the snapshots")
        errors = {r: e for r, (e, _) in enumerate(found) if e is not None}
        raise_errors(errors, "write-out of the snapshots in memory", "nothing was written")
        meta = next(m for _, m in found if m)
        return write_files(self.comm, Path(root), checkpoint_name(done), keep, files, meta)

    def _keep_spare(self, kind: str, file: MappedFile) -> None:
        """Keep ``file`` (an older step's, no longer needed) to be written into next."""
        spare = self._spare_path(kind, self.comm.rank)
        try:
            file.path.replace(spare)
        except FileNotFoundError:  # (cleared meanwhile: a new file next time)
            return
        self.spares[kind] = MappedFile(spare, file.data)

    def _spare_path(self, kind: str, rank: int) -> Path:
        return self.folder / f".rank-{rank:05d}.{kind}.spare"

    def _clear_before(self, done: int) -> None:
        """Remove the files of steps before ``done`` this rank looks after (its own, the copies
        it keeps) and any that no rank of this machine does (an earlier attempt's, of ranks
        now elsewhere or of another world size), and the spares of ranks this machine no
        longer runs (a spare is its rank's own, by its name: a rank renumbered elsewhere by a
        restart writes into new pages there)."""
        rank, world = self.comm.rank, self.comm.world_size
        for held in self.held():
            ours = held.world_size == world and held.rank in self.looked_after
            if held.step < done and (held.rank in (rank, self.copy_from) or not ours):
                (self.folder / snapshot_name(held.step, held.rank, held.world_size)).unlink(
                    missing_ok=True  # (another rank may clear the same stray file)
                )
        for spare in self.folder.glob(".rank-*.spare"):
            if int(spare.name.split(".")[1].removeprefix("rank-")) not in self.machine_ranks:
                spare.unlink(missing_ok=True)

    def _swap(
        self, comm: Comm, mine: Path | None, theirs: Path
    ) -> tuple[MappedFile | None, str | None]:
        """Send this rank's snapshot ``mine`` (None where it could not be written: nothing
        goes) to the next machine's rank and receive the previous machine's into ``theirs``
        (into the spare copy's pages where there is one), on ``comm``: the file received
        (None where nothing was), and the error keeping it, or None."""
        assert self.copy_to is not None and self.copy_from is not None
        sent = _mapped(mine) if mine is not None else torch.empty(0, dtype=torch.uint8)
        size = torch.zeros(1, dtype=torch.int64)
        _exchange(comm, {self.copy_to: torch.tensor([sent.numel()])}, {self.copy_from: size},
                  "the copy to a peer")  # fmt: skip
        nbytes = int(size)
        reused = self.spares.pop("copy", None) if nbytes else None
        pages, error = _receiving(theirs, nbytes, reused)
        into = pages[:nbytes]
        _exchange(
            comm,
            {self.copy_to: sent} if sent.numel() else {},
            {self.copy_from: into} if into.numel() else {},
            "the copy to a peer",
        )
        if error is not None or not nbytes:
            return None, error
        partial_path(theirs).replace(theirs)
        return MappedFile(theirs, pages), None


def check_room(
    nbytes: int, ranks: int, copies: bool, room: int, where: Path, also: str = ""
) -> None:
    """CheckpointError where the snapshots of a machine's ``ranks`` ranks, each ``nbytes``
    (two of each, and two of the copy of another machine's rank with ``copies``), need more
    than ``room`` bytes of ``where`` (``also``: what else the room counts)."""
    need = 2 * ranks * nbytes * (2 if copies else 1)
    if need <= room:
        return
    copied = " and its copy of the previous machine's" if copies else ""
    raise CheckpointError(
        f"checkpoint.in_memory: the snapshots {socket.gethostname()}'s {ranks} rank(s) keep "
        f"({human_bytes(need)}: each rank's state{copied}, of the newest step and the step "
        f"before) do not fit in its memory ({human_bytes(room)} free in {where}"
        f"{' ' + also if also else ''}): turn checkpoint.in_memory off (disk checkpoints "
        "alone), free host memory, or grow /dev/shm (a tmpfs, half the RAM by default)"
    )


def _room(folder: Path) -> int:
    """Bytes the snapshots of ``folder`` may take: the room left in its filesystem (a tmpfs)
    and in host memory, whichever is less, with what its files take now (an earlier attempt's:
    cleared, or written into, by the saves to come)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    held = 0
    for file in folder.iterdir() if folder.is_dir() else []:
        try:
            held += file.stat().st_size
        except FileNotFoundError:  # (renamed or cleared by another rank of the machine)
            continue
    return min(shutil.disk_usage(existing).free, host_available()) + held


def _exchange(comm: Comm, sends: dict, receives: dict, what: str) -> None:
    try:
        comm.send_receive(sends, receives)
    except Exception as exc:
        raise peer_failure(comm, exc, f"the in-memory checkpoint's {what}") from exc


def _holds(holds: list[Held], step: int, rank: int, world: int) -> bool:
    return any((h.step, h.rank, h.world_size) == (step, rank, world) for h in holds)


def _receiving(
    path: Path, nbytes: int, reused: MappedFile | None = None
) -> tuple[torch.Tensor, str | None]:
    """Where ``nbytes`` for file ``path`` are received (the first ``nbytes`` of the tensor
    returned): its partial file's pages (``reused``'s where given), or where that cannot be
    made a buffer of its own (the bytes must still be taken off the wire), with the error."""
    if not nbytes:  # (the peer sent nothing: its snapshot failed, and the agreement says so)
        return torch.empty(0, dtype=torch.uint8), None
    pages: list[torch.Tensor] = []
    error = attempt(lambda: pages.append(mapped_for(partial_path(path), nbytes, reused)))
    if error is not None:
        return torch.empty(nbytes, dtype=torch.uint8), error
    return pages[0], None


def _mapped(path: Path) -> torch.Tensor:
    """The bytes of file ``path`` as a uint8 tensor over its pages (no copy), to be read."""
    return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)


def _snapshot(
    step, done: int, slices: list[Slice], run: dict | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's snapshot of ``step`` after step ``done``: its state dict's tensors and its
    random number generators', and its header: its counters, its ``slices`` and (rank 0) the
    ``run``'s metadata, which write it out as a checkpoint (:meth:`MemoryCheckpoints.write_out`)."""
    sd = step.state_dict()
    tensors = {k: t for k, t in sd.items() if isinstance(t, torch.Tensor)}
    tensors |= {_RNG + kind: state for kind, state in rng_states(step.device).items()}
    meta = {"step": done, "rank": step.comm.rank, "zerocc": sd["zerocc"],
            "slices": [astuple(s) for s in slices], "run": run}  # fmt: skip
    return tensors, meta


def _checkpoint_pieces(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> list[Piece]:
    """What the rank whose snapshot ``path`` is (``tensors`` and ``meta`` read from it) would
    have written of a checkpoint of its step: its slices and its RNG states."""
    if "slices" not in meta:
        raise CheckpointError(
            f"{path} records no slices (an earlier zerocc's): it loads only under the world "
            "that took it"
        )
    rank, slices = meta["rank"], [Slice(*s) for s in meta["slices"]]
    pieces = pieces_of(slices, lambda key: tensors[f"rank{rank}/{key}"])
    rng = {k.removeprefix(_RNG): t for k, t in tensors.items() if k.startswith(_RNG)}
    return pieces + rng_pieces(rank, rng)


def _run_of(meta: dict, done: int) -> dict:
    """The checkpoint metadata of rank 0's snapshot ``meta`` of step ``done``: the run's, as
    of its first save, with the step's counters."""
    counters = meta["zerocc"]
    return meta["run"] | {
        "step": done,
        "optimizer_steps": counters["steps"],
        "micro_batches": counters["micro_batches"],
        "loss_scaler": counters.get("loss_scaler"),
    }


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
