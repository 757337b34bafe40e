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
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from zerocc.errors import ZeroccError
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
# The files of a Hugging Face tokenizer (AutoTokenizer.from_pretrained reads those it finds)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
    "chat_template.jinja", "generation_config.json",
)  # fmt: skip


def export_model(
    checkpoint: str | os.PathLike, out: str | os.PathLike, fmt: str, overwrite: bool = False
) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint, or a folder of them: its newest) to
    ``out`` in ``fmt`` (``safetensors`` or ``torch``); ``out`` an existing folder (or one
    ending in '/') gets the file under the name Hugging Face looks for, and a Hugging Face
    model's ``config.json`` beside it. A file it would write that exists is an error naming
    it, unless ``overwrite``. Returns the file."""
    if fmt not in FORMATS:
        raise CheckpointError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    folder = resolve(checkpoint)
    manifest = Manifest.read(folder)
    as_folder = os.fspath(out).endswith(os.sep)  # (Path drops the trailing separator)
    out = Path(out)
    config = manifest.meta.get("hf_config")  # (a Hugging Face model's: its folder's config.json)
    if as_folder or out.is_dir():
        written = [out / FORMATS[fmt]] + [out / "config.json"] * (config is not None)
    else:
        written = [out]
    if existing := [p for p in written if p.exists()] if not overwrite else []:
        raise ZeroccError(
            f"{', '.join(map(str, existing))}: exist{'s' * (len(existing) == 1)}; "
            "--overwrite replaces it, or name another -o"
        )
    if as_folder or out.is_dir():
        out.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (out / "config.json").write_text(json.dumps(config, indent=2))
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


def copy_tokenizer(
    checkpoint: str | os.PathLike, out: str | os.PathLike, tokenizer: str | None = None
) -> tuple[Path | None, list[Path]]:
    """Copy a tokenizer's files into the folder ``out``, beside an exported model, so that
    ``AutoTokenizer.from_pretrained(out)`` loads it: from ``tokenizer`` (a folder) when given,
    else from the folder the run's plan named (``workload_args.tokenizer``, else a model
    folder ``workload_args.model``, relative to the plan's file, which the checkpoint
    records). Returns the folder read (None when the plan names none) and the files copied;
    CheckpointError for a folder that is not there or holds no tokenizer file."""
    source = Path(tokenizer) if tokenizer is not None else _tokenizer_of(resolve(checkpoint))
    if source is None:
        return None, []
    if not source.is_dir():
        raise CheckpointError(f"tokenizer folder {source} does not exist")
    found = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not found:
        raise CheckpointError(
            f"{source} holds no tokenizer file (looked for {', '.join(TOKENIZER_FILES[:3])}, ...)"
        )
    copied = []
    for path in found:
        target = Path(out) / path.name
        if path.name == "generation_config.json" and target.exists():
            continue
        shutil.copyfile(path, target)
        copied.append(target)
    return source, copied


def _tokenizer_of(folder: Path) -> Path | None:
    """The tokenizer folder the plan of the run that saved ``folder`` named, if any."""
    meta = Manifest.read(folder).meta
    args = (meta.get("plan") or {}).get("workload_args") or {}
    named = args.get("tokenizer") or args.get("model")
    if not isinstance(named, str):
        return None  # (a model given as a config, with no tokenizer: nothing to copy)
    path = Path(named)
    if not path.is_absolute():
        if not meta.get("plan_file"):
            return None  # (a plan given as a dict: relative to a folder nobody knows)
        path = Path(meta["plan_file"]).parent / path
    return path
