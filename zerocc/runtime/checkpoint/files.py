"""The files of a checkpoint: one data file per rank, a JSON manifest, and the folder they
commit to with one rename.

A checkpoint is a folder ``step-00000042`` under the run's checkpoint folder:

- ``rank-00000.bin`` ... : raw tensor bytes, one file per saving rank, written sequentially;
- ``manifest.json``: what every byte is (tensor name, element range, dtype, offset) with a
  checksum of each slice (BLAKE3, which hashes at several GB/s, faster than a disk writes;
  checkpoints of format versions 1 and 2 carry SHA-256, ~1.4 GB/s, and still load), each
  file's size, and the run's metadata. JSON only: opening a checkpoint, even someone else's,
  never runs code (no pickle anywhere).

Saves write into ``.step-00000042.partial`` and rename it to its name once every rank's file
and the manifest are on disk (fsynced), so a crash mid-save leaves the earlier checkpoints as
they were; ``latest`` (a one-line file, itself replaced by a rename) names the newest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import blake3
import torch

from zerocc.errors import CheckpointError

# Version 2: a chunk may hold strided runs (a tensor-parallel rank's rows). Version 3: each
# chunk's checksum is a BLAKE3 ``digest`` (the manifest's ``checksum`` names it), not a SHA-256.
FORMAT, VERSION = "zerocc-checkpoint", 3
READS = (1, 2, VERSION)
CHECKSUM = "blake3"
MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "step-"


@dataclass(frozen=True)
class Chunk:
    """Runs of one tensor's flattened elements, stored one after another at ``offset`` in
    ``file``: run ``k`` of ``runs`` is ``[start + k × stride, stop + k × stride)`` (one run,
    ``[start, stop)``, unless a tensor-parallel slice's rows are saved: they lie ``stride``
    apart in the whole tensor)."""

    file: str
    offset: int
    start: int
    stop: int
    digest: str  # of its bytes, by the manifest's checksum
    stride: int = 0
    runs: int = 1

    @property
    def numel(self) -> int:
        return (self.stop - self.start) * self.runs

    def overlapping(self, start: int, stop: int) -> range:
        """The runs that hold elements of ``[start, stop)``."""
        if self.runs == 1:
            return range(int(self.start < stop and start < self.stop))
        first = max(0, (start - self.stop) // self.stride + 1)
        return range(first, min(self.runs, -(-(stop - self.start) // self.stride)))

    def as_json(self) -> dict[str, Any]:
        """The manifest's record (a single run's without stride and runs, as before they were)."""
        record = asdict(self)
        if self.runs == 1:
            del record["stride"], record["runs"]
        return record


def checksum(data: memoryview, algorithm: str = CHECKSUM) -> str:
    """The hex digest of ``data`` by ``algorithm`` (``blake3``; ``sha256`` for the
    checkpoints of format versions 1 and 2)."""
    if algorithm == "blake3":
        return blake3.blake3(data).hexdigest()
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise CheckpointError(f"manifest names an unknown checksum {algorithm!r} (blake3, sha256)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"manifest names an unknown dtype {name!r}")
    return dtype


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (bf16 included: viewed as bytes)."""
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class DataWriter:
    """Appends tensor slices to one rank's data file, hashing each (BLAKE3) as it goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = path.open("wb")
        self.bytes = 0

    def add(self, values: torch.Tensor, start: int, stride: int = 0, runs: int = 1) -> Chunk:
        """Write ``values``: elements ``start``.. of their tensor's flattened elements, or
        ``runs`` equal runs of them, ``stride`` apart in the tensor (see :class:`Chunk`)."""
        data = as_bytes(values.detach().to("cpu").contiguous())
        offset = self.bytes
        self._file.write(data)
        self.bytes += data.nbytes
        digest = checksum(data)
        stop = start + values.numel() // runs
        return Chunk(self.path.name, offset, start, stop, digest, stride, runs)

    def close(self) -> None:
        """Flush and fsync: the bytes are on disk before the manifest names them."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class DataReader:
    """Reads chunks of a checkpoint's data files, each checked against its checksum (by the
    manifest's ``algorithm``)."""

    def __init__(self, folder: Path, algorithm: str = CHECKSUM) -> None:
        self.folder, self.algorithm = folder, algorithm
        self._files: dict[str, BinaryIO] = {}

    def read(self, chunk: Chunk, dtype: torch.dtype, name: str) -> torch.Tensor:
        """The chunk's elements (1-D, CPU). Raises CheckpointError naming the file and tensor
        when its bytes are missing or do not match the manifest's checksum."""
        out = torch.empty(chunk.numel, dtype=dtype)
        view = as_bytes(out)
        handle = self._open(chunk.file)
        handle.seek(chunk.offset)
        got = handle.readinto(view)
        if got != view.nbytes:
            raise CheckpointError(
                f"{self.folder / chunk.file}: ends after {chunk.offset + got} bytes, but "
                f"{name} [{chunk.start}:{chunk.stop}] needs bytes up to "
                f"{chunk.offset + view.nbytes} (a truncated or replaced file)"
            )
        if checksum(view, self.algorithm) != chunk.digest:
            raise CheckpointError(
                f"{self.folder / chunk.file}: checksum mismatch in {name} "
                f"[{chunk.start}:{chunk.stop}] at byte {chunk.offset} (the file was changed "
                "or corrupted after the save)"
            )
        return out

    def _open(self, file: str) -> BinaryIO:
        if file not in self._files:
            path = self.folder / file
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (the manifest names it)")
            self._files[file] = path.open("rb")
        return self._files[file]

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


# --- the manifest -------------------------------------------------------------------------


@dataclass
class TensorEntry:
    """One saved tensor: its full logical shape and dtype, and the chunks that hold it."""

    shape: list[int]
    dtype: str
    chunks: list[Chunk]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Manifest:
    """What a checkpoint holds. ``meta``: the run's counters, plan, model and optimizer (plain
    JSON); ``tensors``: every saved tensor by name; ``files``: each data file's size;
    ``checksum``: the algorithm of the chunks' digests."""

    meta: dict[str, Any]
    tensors: dict[str, TensorEntry]
    files: dict[str, int]
    checksum: str = CHECKSUM

    def to_json(self) -> str:
        tensors = {
            name: {"shape": e.shape, "dtype": e.dtype, "chunks": [c.as_json() for c in e.chunks]}
            for name, e in self.tensors.items()
        }
        body = {"format": FORMAT, "version": VERSION, "checksum": self.checksum}
        body |= {"meta": self.meta, "files": self.files, "tensors": tensors}
        return json.dumps(body, indent=1)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of the checkpoint ``folder``; CheckpointError when there is none or it
        is not a zerocc checkpoint of a version this zerocc reads."""
        path = folder / MANIFEST
        if not path.is_file():
            raise CheckpointError(
                f"{folder}: no {MANIFEST} (not a zerocc checkpoint, or a save that did not finish)"
            )
        try:
            body = json.loads(path.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a zerocc checkpoint manifest")
        if body.get("version") not in READS:
            raise CheckpointError(
                f"{path}: format version {body.get('version')}, this zerocc reads "
                f"{', '.join(map(str, READS[:-1]))} and {READS[-1]} (a newer zerocc wrote it: "
                "upgrade zerocc)"
            )
        algorithm = body.get("checksum", "sha256")  # (versions 1 and 2: SHA-256, no field)
        tensors = {
            name: TensorEntry(e["shape"], e["dtype"], [_chunk(c) for c in e["chunks"]])
            for name, e in body["tensors"].items()
        }
        manifest = cls(body["meta"], tensors, body["files"], algorithm)
        manifest.check_files(folder)
        manifest.check_tensors(path)
        return manifest

    def check_files(self, folder: Path) -> None:
        """Every data file is there with the size it was saved with."""
        for name, size in self.files.items():
            path = folder / name
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (saved by rank {_rank_of(name)})")
            if path.stat().st_size != size:
                raise CheckpointError(f"{path}: {path.stat().st_size} bytes, the save wrote {size}")

    def check_tensors(self, path: Path) -> None:
        """Every tensor's chunks hold each of its elements at most once, within its shape and
        the files the manifest lists, and a weight's shape is its parameter's in ``meta``: the
        checks every reader of a checkpoint makes (a load, ``zerocc checkpoint``, an export)
        before it reads a byte; CheckpointError naming ``path`` (the manifest) and the tensor."""
        shapes = {f"model/{fqn}": d["shape"] for key in ("params", "buffers")
                  for fqn, d in self.meta.get(key, {}).items()}  # fmt: skip
        for name, entry in self.tensors.items():
            if name in shapes and list(entry.shape) != list(shapes[name]):
                raise CheckpointError(
                    f"{path}: {name} is {entry.shape} in its tensors, {shapes[name]} in its "
                    "params (the manifest was edited: it is not as the save wrote it)"
                )
            itemsize = dtype_of(entry.dtype).itemsize
            held = 0
            for chunk in entry.chunks:
                last = chunk.stop + (chunk.runs - 1) * chunk.stride  # (past its last element)
                size = self.files.get(chunk.file)
                if size is None:
                    raise CheckpointError(f"{path}: {name} names {chunk.file}, which its files "
                                          "do not list (the manifest was edited)")  # fmt: skip
                if chunk.start < 0 or chunk.stop < chunk.start or last > entry.numel:
                    raise CheckpointError(
                        f"{path}: {name} is {entry.shape} ({entry.numel:,} elements), a chunk "
                        f"holds elements [{chunk.start}:{last}] (the manifest was edited)"
                    )
                if chunk.offset + chunk.numel * itemsize > size:
                    raise CheckpointError(
                        f"{path}: {name} [{chunk.start}:{chunk.stop}] ends at byte "
                        f"{chunk.offset + chunk.numel * itemsize} of {chunk.file}, which holds "
                        f"{size} (the manifest was edited)"
                    )
                held += chunk.numel
            # (fewer is a part missing, said by the read of the elements it lacks: a
            # FakeComm's simulated ranks save rank 0's part alone, and load it alike)
            if held > entry.numel:
                raise CheckpointError(
                    f"{path}: {name} is {entry.shape} ({entry.numel:,} elements), its chunks "
                    f"hold {held:,} (the manifest was edited)"
                )


def read_elements(
    manifest: Manifest, reader: DataReader, name: str, start: int = 0, stop: int | None = None
) -> torch.Tensor:
    """Elements ``[start, stop)`` of the saved tensor ``name``, flattened, in its saved dtype."""
    entry = manifest.tensors.get(name)
    if entry is None:
        raise CheckpointError(f"the checkpoint holds no {name} (its manifest does not list it)")
    stop = entry.numel if stop is None else stop
    out = torch.empty(stop - start, dtype=dtype_of(entry.dtype))
    covered = 0
    for chunk in entry.chunks:
        runs = chunk.overlapping(start, stop)
        values = reader.read(chunk, out.dtype, name) if runs else None
        length = chunk.stop - chunk.start
        for k in runs:
            first = chunk.start + k * chunk.stride  # where run k begins in the tensor
            lo, hi = max(start, first), min(stop, first + length)
            at = k * length + lo - first
            out[lo - start : hi - start].copy_(values[at : at + hi - lo])
            covered += hi - lo
    if covered != stop - start:
        raise CheckpointError(
            f"{name}: the checkpoint's chunks cover {covered} of elements [{start}:{stop}] "
            "(a rank's part is missing from the manifest)"
        )
    return out


def _chunk(record: dict[str, Any]) -> Chunk:
    """A manifest's chunk record (versions 1 and 2 name its digest ``sha256``)."""
    if "sha256" in record:
        record = {k: v for k, v in record.items() if k != "sha256"} | {"digest": record["sha256"]}
    return Chunk(**record)


def _rank_of(file: str) -> str:
    return file.removeprefix("rank-").removesuffix(".bin").lstrip("0") or "0"


def data_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


# --- folders ------------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def staging_folder(root: Path, name: str) -> Path:
    return root / f".{name}.partial"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by a rename: readers see the old file or the new one."""
    partial = path.with_name(f".{path.name}.tmp")
    with partial.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    partial.replace(path)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(root: Path, staging: Path, name: str, keep: int | None) -> Path:
    """Make the staged checkpoint visible as ``root/name`` (one rename; an older checkpoint of
    that name is replaced), point ``latest`` at it, and delete all but the newest ``keep``."""
    final = root / name
    _fsync_folder(staging)
    if final.exists():  # a save of the same step again: the old one goes once the new is in
        old = root / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old)
    else:
        staging.rename(final)
    _fsync_folder(root)
    write_atomically(root / LATEST, name + "\n")
    if keep is not None:
        # Only checkpoints older than this one: a later one (a run that went further, saved
        # here) is not this save's to delete, and this one is never deleted by its own keep.
        older = [p for p in saved_checkpoints(root) if p.name < name]
        for stale in older[: max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(stale)
    return final


def saved_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    found = [p for p in root.glob(f"{PREFIX}*") if (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names: a checkpoint folder itself, or a folder of them (its
    ``latest``, else the newest complete one). CheckpointError when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint folder")
    named = latest_named(path)
    if named is not None:
        if (path / named / MANIFEST).is_file():
            return path / named
        raise CheckpointError(
            f"{path / LATEST} names {named}, {gone(path / named)}: name the checkpoint to "
            f"load ({_listed(saved_checkpoints(path))})"
        )
    found = saved_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"{path}: holds no complete checkpoint (no {PREFIX}*/{MANIFEST}; a save that did "
            "not finish leaves only a .partial folder)"
        )
    return found[-1]


def latest_named(root: Path) -> str | None:
    """The checkpoint ``root``'s ``latest`` file names (None without one)."""
    latest = root / LATEST
    return (latest.read_text().strip() or None) if latest.is_file() else None


def gone(named: Path) -> str:
    """Why the checkpoint ``named`` (the one a ``latest`` file names) cannot be loaded."""
    if named.is_dir():
        return f"which has no {MANIFEST} (a damaged folder)"
    return "which is not there (deleted since it was saved)"


def _listed(found: list[Path]) -> str:
    """The checkpoints a user may name instead, said in a few words."""
    if not found:
        return "the folder holds none"
    names = ", ".join(p.name for p in found[-3:])
    return f"it holds {len(found)}, the newest {names}" if len(found) > 3 else f"it holds {names}"
