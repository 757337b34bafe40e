"""A checkpoint's model as one file: every key of ``model.state_dict()``, full tensors in the
model's dtypes, as ``model.load_state_dict(strict=True)`` (or a Hugging Face model's
``from_pretrained``, given the folder with the model's config) takes it.

``safetensors`` is written as a stream: the header is known from the manifest before any
tensor is read, then one tensor at a time is read, checked and written, so the export never
holds more than one tensor (the ``safetensors`` package writes only a dict held whole). ``torch``
(``torch.save``) holds the whole model in memory. Either file appears by a rename, whole.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from zerocc.runtime.checkpoint.files import (
    CheckpointError,
    DataReader,
    Manifest,
    as_bytes,
    dtype_of,
    read_elements,
    resolve,
)
from zerocc.runtime.checkpoint.layout import weight_name
from zerocc.runtime.checkpoint.weight_files import SAFETENSORS_DTYPES

FORMATS = {"safetensors": "model.safetensors", "torch": "pytorch_model.bin"}


def export_model(checkpoint: str | os.PathLike, out: str | os.PathLike, fmt: str) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint, or a folder of them: its newest) to
    ``out`` in ``fmt`` (``safetensors`` or ``torch``); ``out`` an existing folder (or one
    ending in '/') gets the file under the name Hugging Face looks for, and a Hugging Face
    model's ``config.json`` beside it. Returns the file."""
    if fmt not in FORMATS:
        raise CheckpointError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    folder = resolve(checkpoint)
    manifest = Manifest.read(folder)
    as_folder = os.fspath(out).endswith(os.sep)  # (Path drops the trailing separator)
    out = Path(out)
    if as_folder or out.is_dir():
        out.mkdir(parents=True, exist_ok=True)
        if manifest.meta.get("hf_config") is not None:  # a Hugging Face model's folder
            (out / "config.json").write_text(json.dumps(manifest.meta["hf_config"], indent=2))
        out = out / FORMATS[fmt]
    partial = out.with_name(f".{out.name}.partial")
    sources = _sources(manifest)
    reader = DataReader(folder, manifest.checksum)
    try:
        tensors = (
            (key, read_elements(manifest, reader, name).view(shape).to(dtype))
            for key, (name, shape, dtype) in sources.items()
        )  # one at a time, in the model's dtype (a bf16 model's fp32 masters back in bf16)
        if fmt == "safetensors":
            _write_safetensors(partial, sources, tensors)
        else:
            torch.save(dict(tensors), partial)
    finally:
        reader.close()
    partial.replace(out)
    return out


def _sources(manifest: Manifest) -> dict[str, tuple[str, list[int], torch.dtype]]:
    """Every state-dict key (tied names included): its saved tensor, shape and model dtype."""
    meta = manifest.meta
    sources = {}
    for fqn, described in {**meta["params"], **meta["buffers"]}.items():
        for alias in described["aliases"]:
            sources[alias] = (weight_name(fqn), described["shape"], dtype_of(described["dtype"]))
    return {key: sources[key] for key in meta["state_dict_keys"] if key in sources}


def _write_safetensors(
    path: Path,
    sources: dict[str, tuple[str, list[int], torch.dtype]],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """The safetensors layout: an 8-byte little-endian header size, the JSON header (padded
    with spaces to 8 bytes), then each tensor's bytes in header order."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, (_, shape, dtype) in sources.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key}: safetensors has no {dtype}; use --format torch")
        size = dtype.itemsize * math.prod(shape)
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape,
                       "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for _, tensor in tensors:
            handle.write(as_bytes(tensor.contiguous()))
        handle.flush()
        os.fsync(handle.fileno())
