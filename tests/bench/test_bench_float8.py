"""bench/systems.py's float8 systems, what bench/gpu.sh's float8 step times on a GPU (issue 51):
each is found by name and held to the float8 tolerance, and torchao's baseline converts the
layers that zerocc's fp8 plans convert (the comparison is of the same float8 model). Their
timing needs a GPU: float8 matmuls on the CPU are torch's reference kernel."""

from __future__ import annotations

import copy

import pytest
from bench_runs import bench_modules
from model import GPT, GPTConfig

import zerocc
from zerocc.compiler.float8 import Float8Layers

pytest.importorskip("torchao", reason="the float8 layers are torchao's: pip install zerocc[fp8]")
compare, bench_systems = bench_modules("compare", "systems")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_torchao_baseline_converts_the_layers_zerocc_does(recipe):
    from torchao.float8.float8_linear import Float8Linear

    # 64 wide, a vocabulary of 64: every linear layer aligned, the head too (left out by both)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64))
    theirs = copy.deepcopy(model)
    bench_systems._torchao_float8(theirs, recipe)
    plan = zerocc.load_plan({"precision": {"matmul": "fp8", "fp8": {"recipe": recipe}}})
    ours = Float8Layers.convert(model, plan)
    converted = {fqn for fqn, m in theirs.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(ours.layers) and len(converted) == 8
    assert "lm_head" not in converted


def test_each_float8_system_is_found_by_name_and_held_to_its_tolerance():
    systems = bench_systems.all_systems()
    names = list(bench_systems.float8_systems())
    assert names == ["zerocc-z3-inductor-fp8-tensorwise", "torch-compiled-fp8-tensorwise",
                     "zerocc-z3-inductor-fp8-rowwise", "torch-compiled-fp8-rowwise"]  # fmt: skip
    assert all(systems[n].float8 and systems[n].compiled for n in names)
    rows = [
        {"name": "zerocc-z3", "status": "ok", "losses": [2.0], "compiled": False, "float8": False},
        {"name": names[0], "status": "ok", "losses": [2.02], "compiled": True, "float8": True},
    ]
    compare.compare_losses(rows, "bf16")
    assert rows[1]["rtol"] == compare.FLOAT8_RTOL and rows[1]["loss_rel_diff"] <= rows[1]["rtol"]
