"""What a checkpoint folder holds, said without loading it (``zerocc checkpoint``): the
checkpoints under a folder, what one of them was saved by, and whether every byte of it is
as the save wrote it.

Reads the manifests and, to verify, every chunk of every data file against its digest, one
chunk in memory at a time: no model, no ranks, no torch.distributed.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from pathlib import Path

from zerocc.ir.quantities import human_bytes
from zerocc.runtime.checkpoint.files import (
    LATEST,
    MANIFEST,
    PREFIX,
    CheckpointError,
    DataReader,
    Manifest,
    dtype_of,
    gone,
    latest_named,
    saved_checkpoints,
)


@dataclass(frozen=True)
class Saved:
    """One checkpoint of a folder: its folder, its manifest, whether ``latest`` names it."""

    folder: Path
    manifest: Manifest
    latest: bool

    @property
    def nbytes(self) -> int:
        return sum(self.manifest.files.values())


def checkpoints_in(root: Path) -> tuple[list[Saved], list[str]]:
    """The checkpoints of ``root`` (a folder of them, or one checkpoint), oldest first, and a
    line for each folder there that is not one it loads: a save that did not finish, a
    manifest it cannot read."""
    if (root / MANIFEST).is_file():
        return [Saved(root, Manifest.read(root), latest=False)], []
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint or checkpoint folder")
    latest = latest_named(root)
    found, other = [], []
    complete = saved_checkpoints(root)
    for folder in complete:
        try:
            found.append(Saved(folder, Manifest.read(folder), folder.name == latest))
        except CheckpointError as exc:
            other.append(f"{folder.name}: not loaded ({exc})")
    if latest is not None and latest not in {p.name for p in complete}:
        other.append(f"{LATEST}: names {latest}, {gone(root / latest)}: a resume of this "
                     "folder refuses; name the checkpoint to load")  # fmt: skip
    elif latest is None and complete:
        other.append(f"{LATEST}: missing (not written by a save: a resume of this folder "
                     f"loads its newest, {complete[-1].name})")  # fmt: skip
    for partial in sorted(root.glob(f".{PREFIX}*.partial")):
        other.append(
            f"{partial.name}: a save that did not finish (never loaded; the next save of its "
            "step replaces it)"
        )
    if not found and not other:
        raise CheckpointError(f"{root}: holds no checkpoint (no {PREFIX}*/{MANIFEST})")
    return found, other


def summary_line(saved: Saved) -> str:
    """One checkpoint in a line: its name, step, ranks, stage, size and when it was saved."""
    said = record(saved)
    return (
        f"{said['name']}  step {said['step']:>6}  {_ranks(said['world_size']):>9}  "
        f"ZeRO-{said['stage']}  {human_bytes(said['bytes']):>10}  "
        f"{said['saved_at'].replace('T', ' ')[:16]}" + ("  (latest)" if saved.latest else "")
    )


def record(saved: Saved) -> dict:
    """One checkpoint as a JSON-able record: its folder and name, counters, ranks, stage,
    bytes, when it was saved, whether ``latest`` names it, and what saved it."""
    meta = saved.manifest.meta
    when = datetime.datetime.fromtimestamp((saved.folder / MANIFEST).stat().st_mtime)
    return {
        "folder": str(saved.folder),
        "name": saved.folder.name,
        **{key: meta[key] for key in ("step", "optimizer_steps", "micro_batches", "world_size",
                                      "stage")},  # fmt: skip
        "bytes": saved.nbytes,
        "saved_at": when.isoformat(timespec="seconds"),
        "latest": saved.latest,
        "zerocc": meta.get("zerocc"),
        "torch": meta.get("torch"),
    }


def details(saved: Saved) -> list[str]:
    """What a checkpoint holds and what saved it, a line each."""
    meta, tensors = saved.manifest.meta, saved.manifest.tensors
    params = meta.get("params", {})
    elements = sum(math.prod(p["shape"]) for p in params.values())
    trainable = sum(math.prod(p["shape"]) for p in params.values() if p.get("trainable", True))
    weights = {tensors[n].dtype for n in tensors if n.startswith("model/") and n[6:] in params}
    plan = meta.get("plan", {})
    optimizer = meta.get("optimizer", {})
    scaler = meta.get("loss_scaler")
    return [
        f"{saved.folder}: after optimizer step {meta['optimizer_steps']} (step {meta['step']}, "
        f"micro-batch {meta['micro_batches']}), saved by {_ranks(meta['world_size'])} at "
        f"ZeRO-{meta['stage']} (zerocc {meta.get('zerocc', '?')}, torch {meta.get('torch', '?')})",
        f"  model: {len(params)} parameters, {elements:,} elements ({trainable:,} trainable), "
        f"weights in {', '.join(sorted(weights)) or '-'}; {len(meta.get('buffers', {}))} buffers",
        f"  optimizer: {optimizer.get('name', '?')} "
        f"({', '.join(optimizer.get('states', [])) or 'no state'}); "
        f"loss scale: {scaler['scale'] if scaler else 'none'}",
        f"  plan: {meta.get('plan_file') or 'given in code'} (precision "
        f"{plan.get('precision', {}).get('param', '?')}, units "
        f"{', '.join(plan.get('units', {}).get('classes') or []) or 'default'})",
        f"  files: {len(saved.manifest.files)} ({human_bytes(saved.nbytes)}), each chunk with a "
        f"{saved.manifest.checksum.upper()} digest",
    ]


def _ranks(count: int) -> str:
    return f"{count} rank" + "s" * (count != 1)


@dataclass(frozen=True)
class Verified:
    """What a verification read: ``chunks`` chunks of ``tensors`` tensors, ``nbytes`` bytes."""

    tensors: int
    chunks: int
    nbytes: int


def verify(saved: Saved) -> Verified:
    """Read every chunk of ``saved``'s data files and check it against its digest, and that
    the chunks of every tensor hold all of its elements; CheckpointError naming the file and
    tensor of the first that does not (as a load would, but without loading it)."""
    manifest = saved.manifest
    manifest.check_files(saved.folder)
    reader = DataReader(saved.folder, manifest.checksum)
    chunks = nbytes = 0
    try:
        for name, entry in manifest.tensors.items():
            dtype = dtype_of(entry.dtype)
            held = 0
            for chunk in entry.chunks:
                nbytes += reader.read(chunk, dtype, name).nbytes
                held += chunk.numel
                chunks += 1
            # (a load finds a missing part as it reads the elements it lacks: read_elements)
            if held != entry.numel:
                raise CheckpointError(
                    f"{saved.folder}: {name} has {entry.numel:,} elements, its chunks hold "
                    f"{held:,} (a rank's part is missing from the manifest)"
                )
    finally:
        reader.close()
    return Verified(len(manifest.tensors), chunks, nbytes)
