"""Checkpoints a user can trust, in one process: atomic saves, verified loads, clear errors, a
format whose metadata is JSON, and resumes that give the numbers of a run that never stopped."""

from __future__ import annotations

import json

import blake3
import pytest
import torch
from model import GPT, GPTConfig
from models import build
from parity import batch_of

import zerocc
from zerocc.runtime.checkpoint import CheckpointError
from zerocc.runtime.checkpoint import files as ckpt_files

CASE = {"model": "gpt"}
PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "optimizer": {"eps": 1e-3},
    "backend": {"device": "cpu", "kernels": "torch"},
}


def _trained(steps: int = 2, plan: dict | None = None, seed: int = 0):
    step = zerocc.compile(build("gpt", seed=seed), plan or PLAN)
    for i in range(steps):
        step(*batch_of(CASE, i, 0))
    return step


def _losses(step, indices) -> list[float]:
    return [float(step(*batch_of(CASE, i, 0))) for i in indices]


@pytest.mark.parametrize(
    "plan",
    [
        PLAN,
        # fp16: the first step overflows, so the loss scale and skip count must come back too
        {
            **PLAN,
            "zero": {"stage": 2},
            "precision": {"param": "fp16", "dynamic": {"hysteresis": 1}},
        },
        {**PLAN, "grad_accumulation": 2},
    ],
    ids=["fp32", "fp16", "accum2"],
)
def test_a_resumed_run_is_the_run_that_never_stopped(tmp_path, plan):
    accum = plan.get("grad_accumulation", 1)
    straight = zerocc.compile(build("gpt"), plan)
    expected = _losses(straight, range(4 * accum))[2 * accum :]
    _trained(2 * accum, plan).save(tmp_path)
    resumed = zerocc.compile(build("gpt", seed=123), plan)  # other weights until loaded
    assert resumed.load(tmp_path) == []  # same world, stage, plan: nothing to say
    assert _losses(resumed, range(2 * accum, 4 * accum)) == expected
    assert (resumed.loss_scale, resumed.skipped_steps, resumed.steps) == (
        straight.loss_scale, straight.skipped_steps, straight.steps,
    )  # fmt: skip


def test_offloaded_states_on_nvme_save_and_load(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    plan = {**PLAN, "offload": {"optimizer": "nvme", "nvme_path": str(nvme)}}
    first = _trained(2, plan)
    first.save(tmp_path / "ckpt")
    expected = _losses(first, [2, 3])
    resumed = zerocc.compile(build("gpt", seed=123), PLAN)  # loaded without offload
    resumed.load(tmp_path / "ckpt")
    assert _losses(resumed, [2, 3]) == pytest.approx(expected, rel=1e-6)


def test_the_manifest_is_json_and_names_every_tensor_by_model_name(tmp_path):
    step = _trained()
    folder = step.save(tmp_path)
    assert folder.name == "step-00000002" and (tmp_path / "latest").read_text().strip() == (
        folder.name
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    names = set(manifest["tensors"])
    for fqn, value in build("gpt").state_dict().items():
        if fqn in manifest["meta"]["params"]:
            assert f"model/{fqn}" in names and f"optim/{fqn}/exp_avg_sq" in names
            assert manifest["tensors"][f"model/{fqn}"]["shape"] == list(value.shape)
    assert manifest["meta"]["plan"]["zero"]["stage"] == 3
    assert manifest["meta"]["world_size"] == 1 and manifest["meta"]["step"] == 2


def test_keep_deletes_all_but_the_newest(tmp_path):
    step = _trained(1)
    for i in range(1, 4):
        step.save(tmp_path, keep=2)
        step(*batch_of(CASE, i, 0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000003",
    ]


def test_a_save_that_fails_leaves_the_last_checkpoint_intact(tmp_path, monkeypatch):
    step = _trained(1)
    good = step.save(tmp_path)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    step(*batch_of(CASE, 1, 0))
    calls = []

    def failing(self, values, start, *runs):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real(self, values, start, *runs)

    real = ckpt_files.DataWriter.add
    monkeypatch.setattr(ckpt_files.DataWriter, "add", failing)
    with pytest.raises(CheckpointError, match="rank 0: OSError.*No space left.*intact"):
        step.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    monkeypatch.undo()
    fresh = zerocc.compile(build("gpt", seed=123), PLAN)
    fresh.load(tmp_path)
    assert fresh.steps == 1


def test_flipped_bytes_are_found_and_the_file_named(tmp_path):
    folder = _trained().save(tmp_path)
    data = folder / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[1000:1064] = bytes(b ^ 0xFF for b in raw[1000:1064])
    data.write_bytes(bytes(raw))
    fresh = zerocc.compile(build("gpt", seed=123), PLAN)
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: checksum mismatch in \S+"):
        fresh.load(folder)


def test_missing_and_truncated_files_are_named(tmp_path):
    folder = _trained().save(tmp_path)
    data = folder / "rank-00000.bin"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: \d+ bytes, the save wrote"):
        zerocc.compile(build("gpt"), PLAN).load(folder)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: missing \(saved by rank 0\)"):
        zerocc.compile(build("gpt"), PLAN).load(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        zerocc.compile(build("gpt"), PLAN).load(empty)
    with pytest.raises(CheckpointError, match="no such checkpoint or checkpoint folder"):
        zerocc.compile(build("gpt"), PLAN).load(tmp_path / "elsewhere")


def test_another_model_or_optimizer_is_refused_naming_what_differs(tmp_path):
    folder = _trained().save(tmp_path)
    wider = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=24))
    with pytest.raises(
        CheckpointError,
        match=r"another model: it lacks transformer\.h\.2\..*; transformer\.h\.0\.\S+ is \[",
    ):
        zerocc.compile(wider, PLAN).load(folder)
    sgd = {**PLAN, "optimizer": {"name": "sgd", "momentum": 0.9}}
    with pytest.raises(CheckpointError, match="optimizer is adamw .* this plan's is sgd"):
        zerocc.compile(build("gpt"), sgd).load(folder)


def test_a_save_inside_an_accumulation_window_is_refused(tmp_path):
    step = zerocc.compile(build("gpt"), {**PLAN, "grad_accumulation": 2})
    step(*batch_of(CASE, 0, 0))
    with pytest.raises(CheckpointError, match="micro-batch 1 of 2 of step 1"):
        step.save(tmp_path)


def test_weights_load_across_precisions(tmp_path):
    """bf16 compute with fp32 masters saved, loaded into fp32 training: the masters become the
    weights, bit for bit."""
    bf16 = {**PLAN, "precision": {"param": "bf16"}}
    saved = _trained(2, bf16)
    folder = saved.save(tmp_path)
    fp32 = zerocc.compile(build("gpt", seed=123), PLAN)
    fp32.load(folder)
    for name, value in saved.full_state_dict().items():
        assert torch.equal(fp32.full_state_dict()[name], value), name


# --- export -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("name", ["gpt", "buffers"])
def test_export_writes_what_load_state_dict_takes(tmp_path, fmt, name):
    """Tied weights under both names (the GPT's), buffers, and the model's own dtypes: a bf16
    model's fp32 masters come back in bf16."""
    from zerocc.cli.main import main

    model = build(name).to(torch.bfloat16)
    units = PLAN["units"] if name == "gpt" else {}
    step = zerocc.compile(model, {**PLAN, "units": units, "precision": {"param": "bf16"}})
    step(
        *[
            b.to(torch.bfloat16) if b.is_floating_point() else b
            for b in batch_of({"model": name}, 0, 0)
        ]
    )
    step.save(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--format", fmt, "-o", str(tmp_path)]) == 0
    if fmt == "safetensors":
        from safetensors.torch import load_file

        exported = load_file(tmp_path / "model.safetensors")
    else:
        exported = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    fresh = build(name).to(torch.bfloat16)
    fresh.load_state_dict(exported, strict=True)
    expected = step.full_state_dict()
    assert list(exported) == list(expected)
    for name, value in expected.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name


def test_export_of_a_hugging_face_model_writes_its_config_beside_the_weights(tmp_path):
    """What from_pretrained reads from a folder: config.json and model.safetensors (the
    config as the model's ``config.to_json_string()`` gives it; transformers itself is not a
    test dependency)."""
    from zerocc.runtime.checkpoint.export import export_model

    class Config:
        def to_json_string(self) -> str:
            return json.dumps({"model_type": "gpt2", "n_layer": 2})

    model = build("gpt")
    model.config = Config()
    step = zerocc.compile(model, PLAN)
    step.save(tmp_path / "ckpt")
    written = export_model(tmp_path / "ckpt", f"{tmp_path / 'hf'}/", "safetensors")
    assert written == tmp_path / "hf" / "model.safetensors"
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {
        "model_type": "gpt2", "n_layer": 2,
    }  # fmt: skip


def test_the_plans_checkpoint_section_is_validated():
    from zerocc.errors import PlanError

    with pytest.raises(PlanError, match=r"checkpoint\.every: -1 is not allowed.*>= 0"):
        zerocc.load_plan({"checkpoint": {"every": -1}})
    with pytest.raises(PlanError, match=r"checkpoint\.keep: 0 is not allowed.*>= 1"):
        zerocc.load_plan({"checkpoint": {"keep": 0}})
    with pytest.raises(PlanError, match=r"checkpoint\.folder"):
        zerocc.load_plan({"checkpoint": {"folder": "x"}})


def test_checkpoints_of_earlier_format_versions_load_and_a_newer_one_is_refused(tmp_path):
    """Saves write format version 3 with BLAKE3 digests (the manifest names the checksum); a
    version 2 manifest (SHA-256 digests under ``sha256``, no ``checksum`` field) still reads,
    its chunks checked by SHA-256, a changed byte found; a version this zerocc does not know is
    refused, naming the versions it reads."""
    import hashlib

    from zerocc.runtime.checkpoint.files import (
        DataReader,
        DataWriter,
        Manifest,
        TensorEntry,
        read_elements,
    )

    values = torch.arange(8, dtype=torch.float32)
    writer = DataWriter(tmp_path / "rank-00000.bin")
    chunk = writer.add(values, 0)
    writer.close()
    files = {"rank-00000.bin": writer.bytes}  # (every chunk's file listed, as a save lists it)
    written = json.loads(Manifest({}, {"w": TensorEntry([8], "float32", [chunk])}, files).to_json())
    assert (written["version"], written["checksum"]) == (3, "blake3")
    assert (
        written["tensors"]["w"]["chunks"][0]["digest"]
        == blake3.blake3(values.numpy().tobytes()).hexdigest()
    )

    old = dict(written, version=2)
    del old["checksum"]
    record = old["tensors"]["w"]["chunks"][0]
    record["sha256"] = hashlib.sha256(values.numpy().tobytes()).hexdigest()
    del record["digest"]
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    manifest = Manifest.read(tmp_path)
    assert manifest.checksum == "sha256"
    reader = DataReader(tmp_path, manifest.checksum)
    assert torch.equal(read_elements(manifest, reader, "w"), values)
    reader.close()
    with open(tmp_path / "rank-00000.bin", "r+b") as data:
        data.write(b"\x01")
    with pytest.raises(CheckpointError, match="checksum mismatch in w"):
        read_elements(manifest, DataReader(tmp_path, manifest.checksum), "w")

    (tmp_path / "manifest.json").write_text(json.dumps(written | {"version": 4}))
    with pytest.raises(CheckpointError, match="format version 4, this zerocc reads 1, 2 and 3"):
        Manifest.read(tmp_path)


def _edit_shape(folder, *, params: bool) -> str:
    """Take one column off a 2-D weight's shape in the manifest's tensors (and, with
    ``params``, in its params too, alike): the weight's name."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    name = next(n for n, t in manifest["tensors"].items()
                if n.startswith("model/") and len(t["shape"]) == 2)  # fmt: skip
    manifest["tensors"][name]["shape"][1] -= 1
    if params:
        manifest["meta"]["params"][name.removeprefix("model/")]["shape"][1] -= 1
    path.write_text(json.dumps(manifest))
    return name


@pytest.mark.parametrize(
    ("params", "said"),
    [
        (False, r"{name} is \[\d+, \d+\] in its tensors, \[\d+, \d+\] in its params \(the "
                r"manifest was edited"),
        (True, r"{name} is \[\d+, \d+\] \(\d+ elements\), a chunk holds elements "
               r"\[0:\d+\] \(the manifest was edited\)"),
    ],
    ids=["tensors-only", "tensors-and-params"],
)
def test_a_manifest_edited_to_another_shape_is_refused_by_load_and_verify_alike(
    tmp_path, params, said
):
    """Issue 77: a weight's shape edited in the manifest ([56, 127] for [56, 128]): `zerocc
    checkpoint --verify` refused it, a load (`zerocc train --resume`) loaded it without a word.
    Both read it through one check now and refuse it with the same error."""
    from zerocc.runtime.checkpoint.describe import checkpoints_in, verify

    folder = _trained().save(tmp_path)
    name = _edit_shape(folder, params=params)
    with pytest.raises(CheckpointError, match=said.format(name=name)) as loaded:
        zerocc.compile(build("gpt", seed=123), PLAN).load(folder)
    with pytest.raises(CheckpointError) as verified:
        verify(checkpoints_in(folder)[0][0])
    assert str(loaded.value) == str(verified.value)
