"""Saving a step: every rank writes the slice of each tensor it owns, rank 0 the manifest, and
the checkpoint appears by one rename once all of it is on disk.

Every rank writes the same share of every unit (its shard's range of the padded flat, also of
the flats every rank holds whole): the bytes are spread evenly over the ranks, none written
twice. Buffers and the step counter are rank 0's to write; each rank writes its
own RNG states. A failure on any rank (a full disk, a folder it cannot write) fails the save on
every rank, with that rank's error, and leaves earlier checkpoints untouched.

A save is two halves: :func:`stage_checkpoint` takes the rank's slices and the run's metadata
between steps, :func:`write_checkpoint` writes and commits them. A synchronous save runs both
at once on the step's views; a background save (:mod:`~zerocc.runtime.checkpoint.background`)
copies the slices first and writes them on a thread while training goes on.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerocc.compiler.state import optimizer_states
from zerocc.engine.failures import first_line
from zerocc.errors import ZeroccError
from zerocc.ir.ops import TP_GROUP
from zerocc.runtime.checkpoint.agreement import agree, attempt, gathered, raise_errors
from zerocc.runtime.checkpoint.files import (
    LATEST,
    MANIFEST,
    CheckpointError,
    Chunk,
    DataWriter,
    Manifest,
    TensorEntry,
    checkpoint_name,
    commit,
    data_file,
    dtype_name,
    latest_named,
    staging_folder,
)
from zerocc.runtime.checkpoint.layout import (
    STEP_TENSOR,
    rng_name,
    saved_states,
    weight_name,
)

if TYPE_CHECKING:
    from zerocc.engine.comm import Comm
    from zerocc.runtime.checkpoint.checkpointed import Checkpointed

INTACT = "earlier checkpoints are intact"
# One tensor's shape and dtype, and the chunks a rank wrote of it.
Written = dict[str, tuple[list[int], str, list[dict[str, Any]]]]


@dataclass(frozen=True)
class Piece:
    """One slice a rank writes: ``values`` are elements ``start``.. of tensor ``name``'s
    flattened elements (or ``runs`` runs of them, ``stride`` apart; see
    :class:`~zerocc.runtime.checkpoint.files.Chunk`)."""

    name: str
    shape: list[int]
    values: torch.Tensor
    start: int = 0
    stride: int = 0
    runs: int = 1


@dataclass
class StagedSave:
    """One rank's part of a checkpoint as of the step it was taken at: its slices (views of
    the step's state, or copies a background save owns) and the run's metadata."""

    root: Path
    name: str
    keep: int | None
    pieces: list[Piece]
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(p.values.nbytes for p in self.pieces)


def save_checkpoint(runner: Checkpointed, root: str | Path, keep: int | None = None) -> Path:
    """Save ``runner``'s state under ``root`` as ``step-<n>`` (n: optimizer steps taken) and
    return its folder; keep the newest ``keep`` checkpoints there (None: all). Call on every
    rank, between steps (not inside an accumulation window: the partial gradient sums are not
    saved)."""
    return write_checkpoint(runner.comm, stage_checkpoint(runner, root, keep))


def stage_checkpoint(runner: Checkpointed, root: str | Path, keep: int | None) -> StagedSave:
    """What this rank writes of ``runner``'s checkpoint now, as views of its state (a
    background save copies them before the next step changes them); CheckpointError where
    no checkpoint can be taken."""
    accum = runner.plan.grad_accumulation
    if runner.micro_batches % accum:
        raise CheckpointError(
            f"save at micro-batch {runner.micro_batches % accum} of {accum} of step "
            f"{runner.micro_batches // accum + 1}: a checkpoint holds no partial gradient sums; "
            "save after the step's last micro-batch"
        )
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least the checkpoint being saved (keep >= 1)")
    runner.apply_carried_update()  # (offload.defer_updates) the states as of the last step
    name = checkpoint_name(runner.micro_batches // accum)
    return StagedSave(Path(root), name, keep, _rank_pieces(runner), run_metadata(runner))


def rank_checkpoint_bytes(runner: Checkpointed) -> int:
    """Bytes this rank writes of a checkpoint of ``runner`` (what a background save copies)."""
    return sum(piece.values.nbytes for piece in _rank_pieces(runner))


def write_checkpoint(comm: Comm, staged: StagedSave) -> Path:
    """Write every rank's ``staged`` part, rank 0 the manifest, and commit the checkpoint;
    its folder. Every rank calls it with its own part; any rank's failure fails it on all."""
    files = {comm.rank: staged.pieces}
    return write_files(comm, staged.root, staged.name, staged.keep, files, staged.meta)


def write_files(
    comm: Comm,
    root: Path,
    name: str,
    keep: int | None,
    files: dict[int, list[Piece]],
    meta: dict[str, Any],
) -> Path:
    """Write checkpoint ``name`` under ``root``: this rank's data ``files`` (by the rank of
    the run that saved them: in a save, its own; where snapshots in memory are written out,
    ranks of an earlier world's, each written by one rank), rank 0 the manifest (``meta``)
    of every rank's files, and commit it; its folder. A collective; any rank's failure fails
    it on all."""
    staging = staging_folder(root, name)
    prepared = attempt(lambda: _fresh_folder(staging)) if comm.rank == 0 else None
    agree(comm, prepared, "prepare", INTACT)
    written: dict[int, Written] = {}
    sizes: dict[int, int] = {}

    def write() -> None:
        for saved_by, pieces in files.items():
            writer = DataWriter(staging / data_file(saved_by))
            mine = written.setdefault(saved_by, {})
            for piece in pieces:
                chunk = writer.add(piece.values, piece.start, piece.stride, piece.runs)
                dtype = dtype_name(piece.values.dtype)
                mine.setdefault(piece.name, (piece.shape, dtype, []))[2].append(asdict(chunk))
            writer.close()
            sizes[saved_by] = writer.bytes

    everyone = gathered(comm, (attempt(write), written, sizes), "writes")
    errors = {rank: e for rank, (e, _, _) in enumerate(everyone) if e is not None}
    if errors and comm.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise_errors(errors, "write", INTACT)
    final: Path | None = None

    def finish() -> None:
        nonlocal final
        # (by the rank whose file it is; a FakeComm's simulated ranks: rank 0's alone)
        all_written = {r: w for _, by_rank, _ in everyone for r, w in by_rank.items()}
        all_sizes = {r: n for *_, by_rank in everyone for r, n in by_rank.items()}
        _check_every_file_is_here(staging, all_sizes)
        manifest = _manifest(meta, all_written, all_sizes)
        (staging / "manifest.json").write_text(manifest.to_json())
        final = commit(root, staging, name, keep)

    try:
        agree(comm, attempt(finish) if comm.rank == 0 else None, "commit", INTACT)
    except ZeroccError as exc:  # (a peer that left: RankStoppedError)
        if not _committed(root, name):
            raise
        raise SaveCommittedError(root / name, exc) from exc
    return root / name if final is None else final


class SaveCommittedError(CheckpointError):
    """A save whose checkpoint was committed (renamed into place, ``latest`` naming it: it
    loads) although its last agreement failed: a rank left or failed after rank 0 committed
    (killed mid-save, say), or rank 0's pruning of older checkpoints failed. The run's error
    all the same; ``folder`` is the checkpoint, whole; ``silent``: the peers the cause found
    silent (a RankStoppedError's, for the launcher's report)."""

    def __init__(self, folder: Path, cause: BaseException) -> None:
        self.folder = folder
        self.silent = list(getattr(cause, "silent", []))
        super().__init__(
            f"{folder} was committed whole ({LATEST} names it; it loads), but the save did "
            f"not end cleanly: {first_line(cause).removesuffix(f'; {INTACT}')}"
        )


def _committed(root: Path, name: str) -> bool:
    """Whether checkpoint ``name`` of this save is committed under ``root``: renamed into
    place from its staging folder (gone), ``latest`` naming it."""
    staged = staging_folder(root, name)
    return (
        not staged.exists()
        and (root / name / MANIFEST).is_file()
        and latest_named(root) == name
    )


def _check_every_file_is_here(staging: Path, sizes: dict[int, int]) -> None:
    """Every rank's file is in ``staging`` as rank 0 sees it, as large as its rank wrote it:
    a folder on each host's own disk would otherwise commit a checkpoint of rank 0's file
    alone, which no load could read."""
    for rank, size in sizes.items():
        file = staging / data_file(rank)
        seen = file.stat().st_size if file.is_file() else None
        if seen != size:
            found = "no such file" if seen is None else f"{seen} bytes"
            raise CheckpointError(
                f"rank 0 does not see rank {rank}'s file as written ({file}: {found}, rank "
                f"{rank} wrote {size} bytes): the checkpoint folder must be one folder every "
                "rank sees (a shared filesystem), not a folder on each host's own disk"
            )


def _fresh_folder(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)  # a save of this step that crashed before
    staging.mkdir(parents=True)


@dataclass(frozen=True)
class Slice:
    """Where one piece a rank saves lies in its state: elements ``[at, at + numel)`` of state
    ``key``'s flattened elements are elements ``start``.. of tensor ``name``'s (``runs`` runs
    of them, ``stride`` apart: see :class:`Piece`). A rank's slices depend on its layout alone:
    an in-memory snapshot records them beside its state, to be written out as a checkpoint
    of its world (:meth:`~zerocc.runtime.checkpoint.in_memory.MemoryCheckpoints.write_out`)."""

    name: str
    shape: list[int]
    key: str
    at: int
    numel: int
    start: int = 0
    stride: int = 0
    runs: int = 1


def state_slices(runner: Checkpointed) -> list[Slice]:
    """This rank's slices of its state: its range of each unit's weights and optimizer states
    (under hybrid sharding, the first replica's ranks only: the others hold the same shards),
    on the first rank of each pipeline stage (rank 0 without one) its buffers, and on rank 0
    the step counter (the loss scaler's state is in the manifest). What an earlier pipeline
    rank holds too, it writes."""
    rank, mesh, elsewhere = runner.comm.rank, runner.mesh, runner.saved_elsewhere
    slices: list[Slice] = []
    states = saved_states(runner.units, runner.layout, optimizer_states(runner.plan.optimizer))
    splits, tp_rank = runner.session.splits, mesh.tp_rank(rank)
    whole = {p.fqn: list(p.shape) for p in runner.full_model_info.params}
    for flat in states if mesh.replica(rank) == 0 else []:
        key = flat.spec.key
        for piece in flat.pieces(mesh.group_rank(flat.unit.group, rank)):
            name, fqn = flat.name(piece.param), piece.param.fqn
            split = splits.get(fqn)
            if fqn in elsewhere or (tp_rank != 0 and (split is None or split.group != TP_GROUP)):
                continue  # (every tp rank holds what tensor parallelism does not split alike)
            numel = piece.stop - piece.start
            if split is None:
                slices.append(Slice(name, whole[fqn], key, piece.at, numel, piece.start))
                continue
            # this rank's rows of it (its tp slice, or its experts)
            row, at = split.row(piece.param.param.shape), mesh.group_rank(split.group, rank)
            for lo, first, length, runs in split.runs(piece.start, piece.stop, at, row):
                slices.append(Slice(name, whole[fqn], key, piece.at + lo - piece.start,
                                    length * runs, first, split.parts * row, runs))  # fmt: skip
    if rank % mesh.stage_ranks:
        return slices
    for buffer in runner.session.model_info.buffers:
        if buffer.fqn in runner.state and buffer.fqn not in elsewhere:
            numel = runner.state[buffer.fqn].numel()
            slices.append(Slice(weight_name(buffer.fqn), list(buffer.shape), buffer.fqn, 0, numel))
    if rank == 0 and "optim.step" in runner.state:
        slices.append(Slice(STEP_TENSOR, [], "optim.step", 0, 1))
    return slices


def pieces_of(slices: list[Slice], state: Callable[[str], torch.Tensor]) -> list[Piece]:
    """The pieces ``slices`` name, as views of the tensors ``state`` gives by key (each
    asked for once)."""
    flats: dict[str, torch.Tensor] = {}
    pieces = []
    for s in slices:
        if s.key not in flats:
            flats[s.key] = state(s.key).reshape(-1)
        values = flats[s.key][s.at : s.at + s.numel]
        pieces.append(Piece(s.name, s.shape, values, s.start, s.stride, s.runs))
    return pieces


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random number generators' states, by device type."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def rng_pieces(rank: int, rng: dict[str, torch.Tensor]) -> list[Piece]:
    """The pieces of rank ``rank``'s random number generators' states (by device type)."""
    return [Piece(rng_name(rank, kind), list(state.shape), state) for kind, state in rng.items()]


def _rank_pieces(runner: Checkpointed) -> list[Piece]:
    """This rank's slices of its state (:func:`state_slices`) and its RNG states."""
    pieces = pieces_of(state_slices(runner), runner.state.read)
    return pieces + rng_pieces(runner.comm.rank, rng_states(runner.device))


def _manifest(
    meta: dict[str, Any], written: dict[int, Written], sizes: dict[int, int]
) -> Manifest:
    tensors: dict[str, TensorEntry] = {}
    for _, rank_written in sorted(written.items()):
        for name, (shape, dtype, chunks) in rank_written.items():
            entry = tensors.setdefault(name, TensorEntry(shape, dtype, []))
            entry.chunks += [Chunk(**c) for c in chunks]
    for entry in tensors.values():
        entry.chunks.sort(key=lambda c: c.start)
    files = {data_file(rank): size for rank, size in sorted(sizes.items())}
    return Manifest(meta, tensors, files)


def _zerocc_version() -> str:
    try:
        return importlib.metadata.version("zerocc")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def run_metadata(runner: Checkpointed) -> dict[str, Any]:
    """What a checkpoint says of the run besides its tensors: counters, world, plan, model
    (every parameter whole, under tensor parallelism too)."""
    info = runner.full_model_info

    def described(p) -> dict[str, Any]:
        return {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "aliases": list(p.aliases)}

    plan = runner.plan
    return {
        "step": runner.micro_batches // plan.grad_accumulation,
        "optimizer_steps": runner.steps,
        "micro_batches": runner.micro_batches,
        "world_size": runner.comm.world_size,
        "stage": plan.zero.stage,
        "zerocc": _zerocc_version(),
        "torch": torch.__version__,
        "plan": plan.model_dump(mode="json"),
        "optimizer": {
            "name": plan.optimizer.name,
            "states": list(optimizer_states(plan.optimizer)),
        },
        "loss_scaler": runner.loss_scaler.state_dict() if runner.loss_scaler else None,
        "params": {p.fqn: described(p) | {"trainable": p.requires_grad} for p in info.params},
        "buffers": {b.fqn: described(b) for b in info.buffers},
        "state_dict_keys": list(runner.state.state_dict_keys),
        "hf_config": _hf_config(runner.model),
        # (where the plan's relative paths start: the export finds the tokenizer from it)
        "plan_file": str(Path(plan.source).resolve()) if plan.source else None,
    }


def _hf_config(model) -> dict[str, Any] | None:
    """A Hugging Face model's config (``model.config.to_json_string()``), for the export to
    write beside the weights as from_pretrained reads them; None for other models."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return None
    return json.loads(config.to_json_string())
