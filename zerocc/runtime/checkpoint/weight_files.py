"""A model's weight files, read one tensor at a time: how a model built on the ``meta`` device
starts from pretrained values without any rank holding the whole model.

The files are Hugging Face's: ``model.safetensors``, or shards named by
``model.safetensors.index.json``; ``pytorch_model.bin`` (torch.save's zip format, memory-mapped,
not read whole) or shards named by ``pytorch_model.bin.index.json``. :func:`bind` matches them
to a model by name (every alias of a tied parameter; a Hugging Face model's keys with or
without its ``base_model_prefix``) and checks every shape before anything is read;
:func:`zerocc.weights_from` binds and hands the result to zerocc, which reads each unit's
tensors as it builds the unit's shards (:func:`zerocc.compiler.materialize.initial_values`).
Every rank reads the files itself: they must be the same files on every rank, as the plan is.
The ranks compare the files' fingerprints (:meth:`WeightFiles.fingerprint`: each file's size and
sampled bytes) before any rank reads a weight, so copies that differ across hosts (another
revision, a truncated download) stop every rank with an error naming the file, never a model
made of two.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from zerocc.compiler.capture import describe_model
from zerocc.compiler.materialize import use_weights
from zerocc.errors import CheckpointError

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
_DTYPES_OF = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
# The names Hugging Face gives a model's weights, in the order it prefers them.
NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# A weight file's fingerprint reads SAMPLES chunks of SAMPLE_BYTES spread evenly over it (2 MiB
# of a 5 GB shard: milliseconds on a local disk), all of it when it is smaller.
SAMPLES = 32
SAMPLE_BYTES = 1 << 16


class NotMapped(CheckpointError):
    """A torch file saved in the format before zip (torch < 1.6): it can only be read whole."""


@dataclass(frozen=True)
class _Entry:
    """Where one tensor is: its file, dtype and shape, and (safetensors) its bytes' offset."""

    file: Path
    dtype: torch.dtype
    shape: torch.Size
    offset: int = -1  # from the file's start; -1 in a torch file (read by key)


class WeightFiles:
    """The tensors of one model's weight files (a folder, or one file or index), by key.

    Opening reads only the files' headers (safetensors) or maps them (torch); :meth:`read`
    reads one tensor's bytes. Raises CheckpointError naming the path when there are no weight
    files, a file is missing or not one of the formats.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files = _files_of(self.path)
        self.entries: dict[str, _Entry] = {}
        self._mapped: dict[Path, dict[str, torch.Tensor]] = {}  # torch files, memory-mapped
        for file in self.files:
            if file.suffix == ".safetensors":
                self.entries.update(_safetensors_entries(file))
            else:
                mapped = self._mapped[file] = _mapped(file)
                self.entries.update((k, _Entry(file, t.dtype, t.shape)) for k, t in mapped.items())

    def __repr__(self) -> str:
        kind = "safetensors" if self.files[0].suffix == ".safetensors" else "torch"
        return f"{self.path} ({kind}, {len(self.files)} file(s), {len(self.entries)} tensors)"

    def fingerprint(self) -> str:
        """One line per file: its name, size and a digest of sampled bytes (see
        :func:`sampled_digest`). Copies of the same files give the same lines on any host."""
        return "\n".join(
            f"{file.name}: {file.stat().st_size} bytes, sampled {sampled_digest(file)}"
            for file in self.files
        )

    def read(self, key: str) -> torch.Tensor:
        """The tensor saved under ``key``, as saved (dtype and shape), in fresh memory."""
        entry = self.entries[key]
        return self.read_range(key, 0, entry.shape.numel()).view(entry.shape)

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the tensor saved under ``key``, flattened in row-major
        order, as saved (dtype), in fresh memory: only their bytes are read."""
        entry = self.entries[key]
        if entry.offset < 0:
            return self._mapped[entry.file][key].reshape(-1)[start:stop].clone()
        tensor = torch.empty(stop - start, dtype=entry.dtype)
        into = memoryview(tensor.view(torch.uint8).numpy())
        with entry.file.open("rb") as handle:
            handle.seek(entry.offset + start * tensor.element_size())
            if len(into) and handle.readinto(into) != len(into):
                raise CheckpointError(f"{entry.file}: {key} ends past the file's end (truncated?)")
        return tensor


def sampled_digest(file: Path) -> str:
    """A SHA-256 (16 hex digits) of ``file``'s size and of :data:`SAMPLES` chunks of
    :data:`SAMPLE_BYTES` spread evenly over it, the first and the last included (the whole file
    when it is smaller): tells two copies apart without reading either whole."""
    size = file.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with file.open("rb") as handle:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(handle.read())
        else:
            for i in range(SAMPLES):
                handle.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _files_of(path: Path) -> list[Path]:
    """The weight files ``path`` names: itself, its index's shards, or a folder's."""
    if path.is_dir():
        found = next((path / name for name in NAMES if (path / name).is_file()), None)
        if found is None:
            raise CheckpointError(f"{path}: no weight files (looked for {', '.join(NAMES)})")
        path = found
    if not path.is_file():
        raise CheckpointError(f"{path}: no such weight file or folder")
    if not path.name.endswith(".index.json"):
        return [path]
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not an index of weight files ({exc})") from None
    files = [path.parent / name for name in dict.fromkeys(weight_map.values())]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"{path} names files that are not there: {', '.join(absent)}")
    return files


def _safetensors_entries(file: Path) -> dict[str, _Entry]:
    """The header of a safetensors file: an 8-byte little-endian size, then JSON."""
    with file.open("rb") as handle:
        head = handle.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        try:
            header = json.loads(handle.read(size)) if 0 < size < file.stat().st_size else None
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (no readable header)")
    header.pop("__metadata__", None)
    entries = {}
    for key, described in header.items():
        dtype = _DTYPES_OF.get(described.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{file}: {key} has dtype {described.get('dtype')!r}, "
                                  f"not one of {', '.join(_DTYPES_OF)}")  # fmt: skip
        begin = described["data_offsets"][0]
        entries[key] = _Entry(file, dtype, torch.Size(described["shape"]), 8 + size + begin)
    end = 8 + size + max((d["data_offsets"][1] for d in header.values()), default=0)
    if end > file.stat().st_size:  # found here, by every rank, not by the one that reads there
        raise CheckpointError(f"{file}: its header describes {end} bytes, the file has "
                              f"{file.stat().st_size} (truncated?)")  # fmt: skip
    return entries


def _mapped(file: Path) -> dict[str, torch.Tensor]:
    """A torch.save'd state dict, memory-mapped (pages read when a tensor is), no code run."""
    try:
        loaded = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, pickle's and zipfile's own errors
        raise NotMapped(
            f"{file}: cannot be mapped ({type(exc).__name__}: {exc}); torch.save's zip "
            "format (torch >= 1.6) maps, an older file must be read whole"
        ) from None
    tensors = isinstance(loaded, dict) and all(isinstance(t, torch.Tensor) for t in loaded.values())
    if not tensors:
        raise CheckpointError(f"{file}: not a state dict (a dict of tensors)")
    return loaded


@dataclass
class BoundWeights:
    """A model's tensors matched to their entries in weight files: what zerocc reads.

    ``names`` maps every model name that has an entry (tied aliases included) to its key;
    ``missing`` lists the model's tensors on ``meta`` that have none (one name each), and
    ``unused`` the keys no model tensor takes.
    """

    files: WeightFiles
    names: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def read(self, name: str) -> torch.Tensor:
        """The value of the model's tensor ``name``, as saved."""
        return self.files.read(self.names[name])

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the model's tensor ``name``, flattened, as saved."""
        return self.files.read_range(self.names[name], start, stop)

    def describe(self) -> str:
        """One line for explain(): where the initial weights come from."""
        return f"initial weights read from {self.files}, one unit at a time"

    def fingerprint(self) -> str:
        """The files' fingerprint (:meth:`WeightFiles.fingerprint`), under a line that says
        what they are; not their path, which may differ from host to host."""
        return f"weight files, {len(self.files.files)}:\n{self.files.fingerprint()}"


def bind(files: WeightFiles, model: nn.Module) -> BoundWeights:
    """Match ``model``'s parameters and buffers on the ``meta`` device to ``files`` by name.

    A Hugging Face model's names are also looked up without (and with) its
    ``base_model_prefix``, as ``from_pretrained`` does for a base model's files. Raises
    CheckpointError for an entry whose shape is not the tensor's, and for an entry of a
    tensor that holds values already (they would be silently kept).
    """
    bound = BoundWeights(files)
    prefix = getattr(model, "base_model_prefix", "") or ""
    described = describe_model(model)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for info in [*described.params, *described.buffers]:
        tensor = tensors[info.fqn]
        found = False
        for name in info.aliases:
            key = next((k for k in _candidates(name, prefix) if k in files.entries), None)
            if key is None:
                continue
            shape = files.entries[key].shape
            if shape != tensor.shape:
                raise CheckpointError(
                    f"{files.path}: {key} has shape {list(shape)}, the model's {name} "
                    f"{list(tensor.shape)}: these files are not this model's"
                )
            if not tensor.is_meta:
                raise CheckpointError(
                    f"the model's {name} holds values already, and {files.path} has it: build "
                    "the model on the meta device (under `with torch.device('meta'):`) for "
                    "zerocc to read its weights from the files"
                )
            bound.names[name] = key
            found = True
        if not found and tensor.is_meta:
            bound.missing.append(info.fqn)
    taken = set(bound.names.values())
    bound.unused = [k for k in files.entries if k not in taken]
    return bound


def _candidates(name: str, prefix: str) -> list[str]:
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name.removeprefix(prefix + ".")]
    return [name, f"{prefix}.{name}"]


def weights_from(model: nn.Module, path: str | os.PathLike) -> BoundWeights:
    """Bind ``model`` (built on ``meta``) to the weight files at ``path`` (see :func:`bind`);
    zerocc then reads each unit's tensors as it builds the unit's shards, never the whole
    model. Every meta tensor must be in the files (CheckpointError listing those that are
    not; give them values before); keys the model does not take are warned of."""
    bound = bind(WeightFiles(path), model)
    if bound.missing:
        shown = ", ".join(bound.missing[:8]) + (" ..." if len(bound.missing) > 8 else "")
        raise CheckpointError(
            f"{path}: {len(bound.missing)} of the model's tensors on the meta device are not in "
            f"the files: {shown}; give them values first (tensors that hold values are used as "
            "they are; a non-persistent buffer is never in the files: set it on the model)"
        )
    if bound.unused:
        shown = ", ".join(bound.unused[:8]) + (" ..." if len(bound.unused) > 8 else "")
        warnings.warn(
            f"{path}: {len(bound.unused)} tensor(s) in the files are not the model's and are "
            f"not read: {shown}",
            stacklevel=2,
        )
    use_weights(model, bound)
    return bound
