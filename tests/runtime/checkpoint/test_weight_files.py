"""zerocc.weights_from: a model built on ``meta`` starts from weight files, read one unit at a
time as each rank builds its shards (zerocc/runtime/checkpoint/weight_files.py), in every form
Hugging Face writes them; and what is wrong with the files is said before a step runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from models import build
from parity import batch_of

import zerocc
from zerocc.errors import CheckpointError
from zerocc.runtime.checkpoint.weight_files import (
    SAMPLE_BYTES,
    SAMPLES,
    WeightFiles,
    sampled_digest,
)

safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="tests write the files with safetensors: pip install -e '.[dev]'"
)

PLAN = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "optimizer": {"eps": 1e-3}}
FORMS = ["safetensors", "safetensors-sharded", "torch", "torch-sharded"]


def _canonical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under one name each (a tied one's first), as save_pretrained
    writes them: the files then hold ``transformer.wte.weight`` but not ``lm_head.weight``."""
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    return {k: v.detach().clone() for k, v in named.items()}


def _save(tensors: dict[str, torch.Tensor], folder: Path, form: str) -> Path:
    """``tensors`` in ``folder`` as Hugging Face names them: one file, or two and an index."""
    folder.mkdir(parents=True, exist_ok=True)
    kind, _, sharded = form.partition("-")
    suffix, write = {
        "safetensors": (".safetensors", safetensors_torch.save_file),
        "torch": (".bin", torch.save),
    }[kind]
    base = "model" if kind == "safetensors" else "pytorch_model"
    if not sharded:
        write(tensors, folder / f"{base}{suffix}")
        return folder
    keys = list(tensors)
    halves = {f"{base}-0000{i + 1}-of-00002{suffix}": keys[i::2] for i in range(2)}
    for name, part in halves.items():
        write({k: tensors[k] for k in part}, folder / name)
    index = {"weight_map": {k: name for name, part in halves.items() for k in part}}
    (folder / f"{base}{suffix}.index.json").write_text(json.dumps(index))
    return folder


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return build("gpt", seed=1)


@pytest.mark.parametrize("form", FORMS)
def test_a_meta_model_reads_its_files_one_unit_at_a_time(tmp_path, monkeypatch, form):
    """Each tensor read once, unit by unit (stage 2: each unit's flat built whole, as the
    replicated weights are), and the model never materialized."""
    import zerocc.compiler.state as state_module

    real = build("gpt", seed=3)
    folder = _save(_canonical(real), tmp_path / "model", form)
    model = _meta_gpt()
    zerocc.weights_from(model, folder)
    sizes = []
    initial_values = state_module.initial_values

    def counting(*args):
        values = initial_values(*args)
        sizes.append(sum(v.numel() for v in values.values()))
        return values

    monkeypatch.setattr(state_module, "initial_values", counting)
    reads = []
    read_range = WeightFiles.read_range
    monkeypatch.setattr(
        WeightFiles,
        "read_range",
        lambda self, key, *span: reads.append(key) or read_range(self, key, *span),
    )
    step = zerocc.compile(model, {**PLAN, "zero": {"stage": 2}}, comm=zerocc.FakeComm(2))
    assert all(p.is_meta for p in model.parameters())  # never materialized whole
    assert max(sizes) == max(u.numel for u in step.units)
    assert sorted(reads) == sorted(_canonical(real))  # each tensor read once
    values = _canonical(real)
    for unit in step.units:  # stage 2: the replicated flat weights
        assert torch.equal(step.state[f"{unit.key}.param"], unit.flatten(values)), unit.name
    assert f"initial weights read from {folder}" in step.explain()
    assert torch.isfinite(step(*batch_of({"model": "gpt"}, 0, 0)))


@pytest.mark.parametrize("form", ["safetensors", "torch"])
def test_a_stage_3_rank_reads_only_its_shard(tmp_path, monkeypatch, form):
    """At stage 3 a rank keeps only its shard of each unit, and reads only that: of 4 ranks,
    a quarter of each unit's elements (every tensor of the unit, its shard's part of it)."""
    real = build("gpt", seed=3)
    model = _meta_gpt()
    zerocc.weights_from(model, _save(_canonical(real), tmp_path / "model", form))
    ranges = []
    read_range = WeightFiles.read_range

    def recording(self, key, start, stop):
        ranges.append((key, start, stop))
        return read_range(self, key, start, stop)

    monkeypatch.setattr(WeightFiles, "read_range", recording)
    step = zerocc.compile(model, PLAN, comm=zerocc.FakeComm(4))  # rank 0 of 4
    values = _canonical(real)
    for unit in step.units:
        expected = unit.shard_of(unit.flatten(values), 0)
        assert torch.equal(step.state[f"{unit.key}.param"], expected), unit.name
    read = sum(stop - start for _, start, stop in ranges)
    assert read == sum(min(u.shard_numel, u.numel) for u in step.units)  # a quarter, not all


def test_materialize_reads_the_files_and_keeps_ties(tmp_path):
    real = build("gpt", seed=3)
    model = _meta_gpt()
    zerocc.weights_from(model, _save(_canonical(real), tmp_path / "model", "safetensors"))
    zerocc.materialize(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in real.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_files_dtype_is_cast_to_the_models(tmp_path):
    real = build("gpt", seed=3)
    halves = {k: v.to(torch.bfloat16) for k, v in _canonical(real).items()}
    model = _meta_gpt()
    zerocc.weights_from(model, _save(halves, tmp_path / "model", "safetensors"))
    zerocc.materialize(model)
    for name, value in halves.items():
        assert model.state_dict()[name].dtype == torch.float32
        assert torch.equal(model.state_dict()[name], value.float()), name


def _without(tensors: dict, key: str) -> dict:
    return {k: v for k, v in tensors.items() if k != key}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: _without(t, "transformer.ln_f.weight"),
         r"1 of the model's tensors on the meta device are not in the files: .*ln_f\.weight"),
        (lambda t: {**t, "transformer.ln_f.weight": torch.ones(3)},
         r"ln_f\.weight has shape \[3\], the model's transformer\.ln_f\.weight \[16\]"),
    ],
    ids=["missing", "shape"],
)  # fmt: skip
def test_files_that_are_not_the_models_are_refused(tmp_path, change, message):
    folder = _save(change(_canonical(build("gpt"))), tmp_path / "model", "safetensors")
    with pytest.raises(CheckpointError, match=message):
        zerocc.weights_from(_meta_gpt(), folder)


def test_a_model_that_holds_values_is_refused(tmp_path):
    folder = _save(_canonical(build("gpt")), tmp_path / "model", "safetensors")
    with pytest.raises(CheckpointError, match="holds values already.*meta device"):
        zerocc.weights_from(build("gpt"), folder)


def test_tensors_the_model_does_not_have_are_warned_of(tmp_path):
    extra = {**_canonical(build("gpt")), "head.bias": torch.zeros(2)}
    folder = _save(extra, tmp_path / "model", "safetensors")
    with pytest.warns(UserWarning, match="1 tensor.* not the model's and are not read: head.bias"):
        zerocc.weights_from(_meta_gpt(), folder)


def test_broken_files_are_named(tmp_path):
    tensors = _canonical(build("gpt"))
    with pytest.raises(CheckpointError, match="no weight files"):
        WeightFiles(tmp_path)
    sharded = _save(tensors, tmp_path / "sharded", "safetensors-sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names files that are not there: model-00002"):
        WeightFiles(sharded)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        WeightFiles(tmp_path / "garbage")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(tensors, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="cannot be mapped.*zip format"):
        WeightFiles(legacy)


def test_a_truncated_file_is_found_when_bound(tmp_path):
    folder = _save(_canonical(build("gpt")), tmp_path / "model", "safetensors")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="header describes .* bytes, the file has"):
        zerocc.weights_from(_meta_gpt(), folder)  # on every rank, before a rank reads


def _from_own_copy(
    rank: int, world: int, root: str, own: bool = True
) -> tuple[list[float], str | None, int]:
    """Rank ``rank`` reads its own copy of the files (``root``/rank<r>), as on a host of its own
    (``own``; else rank 0's copy, as from a shared folder); returns its losses, the error that
    stopped it (None), and how many tensors it read."""
    from zerocc.errors import RankMismatchError

    reads = []
    read_range = WeightFiles.read_range
    WeightFiles.read_range = lambda self, key, *span: (
        reads.append(key) or read_range(self, key, *span)
    )
    model = _meta_gpt()
    zerocc.weights_from(model, Path(root) / f"rank{rank if own else 0}")
    try:
        step = zerocc.compile(model, {**PLAN, "backend": {"device": "cpu"}})
    except RankMismatchError as exc:
        return [], str(exc), len(reads)
    losses = [float(step(*batch_of({"model": "gpt"}, i, rank))) for i in range(2)]
    return losses, None, len(reads)


def test_ranks_whose_copies_of_the_files_differ_stop_before_reading_any(tmp_path):
    """Each rank reads its own copy: copies alike (another path, another time) train; a copy
    of other weights stops every rank before any weight is read, naming the file."""
    from multirank import run_ranks

    _save(_canonical(build("gpt", seed=3)), tmp_path / "rank0", "safetensors")
    shutil.copytree(tmp_path / "rank0", tmp_path / "rank1")
    copies = run_ranks(2, _from_own_copy, str(tmp_path))
    assert copies == run_ranks(2, _from_own_copy, str(tmp_path), False)  # as from one folder
    assert all(error is None and len(losses) == 2 for losses, error, _ in copies)

    _save(_canonical(build("gpt", seed=4)), tmp_path / "rank1", "safetensors")  # other values
    for losses, error, reads in run_ranks(2, _from_own_copy, str(tmp_path)):
        assert not losses and reads == 0
        assert "the ranks do not start alike" in error, error
        assert "rank 0: model.safetensors" in error and "rank 1: model.safetensors" in error


def test_a_files_fingerprint_reads_samples_of_it_and_tells_copies_apart(tmp_path):
    """A file larger than the samples is told apart by a changed sampled chunk (the middle one
    here) or its size, and the same bytes elsewhere give the same digest."""
    size = 2 * SAMPLES * SAMPLE_BYTES + 12345
    data = bytearray(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data)
    assert sampled_digest(tmp_path / "a") == sampled_digest(tmp_path / "b")
    middle = (SAMPLES // 2) * (size - SAMPLE_BYTES) // (SAMPLES - 1)  # a sampled chunk's start
    data[middle + 7] ^= 1
    (tmp_path / "b").write_bytes(data)
    assert sampled_digest(tmp_path / "a") != sampled_digest(tmp_path / "b")
    (tmp_path / "b").write_bytes(bytes(data[:-1]))
    assert sampled_digest(tmp_path / "a") != sampled_digest(tmp_path / "b")
