"""`zerocc export -o` and `zerocc plan import -o` refuse an output that exists, naming it,
unless `--overwrite` (the flag `zerocc train` replaces another run's checkpoints with): both
overwrote what was there without a word (issue 77)."""

from __future__ import annotations

from pathlib import Path

import torch
from models import build

import zerocc
from zerocc.cli.main import main

DEEPSPEED = Path(__file__).parents[1] / "fixtures" / "deepspeed" / "zero2_offload.json"
PLAN = {"zero": {"stage": 3}, "units": {"classes": ["Block"]},
        "backend": {"device": "cpu", "kernels": "torch"}}  # fmt: skip


def test_export_refuses_an_existing_file_unless_overwrite(tmp_path, capsys):
    step = zerocc.compile(build("gpt"), PLAN)
    x = torch.randint(0, 32, (2, 8))
    step(x, x)
    step.save(tmp_path / "ckpt")
    out = tmp_path / "model.pt"
    out.write_bytes(b"the user's own file")
    export = ["export", str(tmp_path / "ckpt"), "--format", "torch", "-o", str(out)]
    assert main(export) == 2
    assert f"zerocc: error: {out}: exists; --overwrite replaces it, or name another -o" in (
        capsys.readouterr().err
    )
    assert out.read_bytes() == b"the user's own file"
    assert main([*export, "--overwrite"]) == 0
    assert set(torch.load(out)) == set(build("gpt").state_dict())
    folder = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "-o", f"{folder}/"]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(folder)]) == 2  # (its file there)
    assert f"{folder / 'model.safetensors'}: exists" in capsys.readouterr().err


def test_plan_import_refuses_an_existing_plan_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    out.write_text("# the user's own plan\n")
    imported = ["plan", "import", str(DEEPSPEED), "-o", str(out)]
    assert main(imported) == 2
    assert f"zerocc: error: {out}: exists; --overwrite replaces it, or name another -o" in (
        capsys.readouterr().err
    )
    assert out.read_text() == "# the user's own plan\n"
    assert main([*imported, "--overwrite"]) == 0
    assert zerocc.load_plan(out).zero.stage == 2
