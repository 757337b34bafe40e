"""partition: which parameters land in which unit."""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

import pytest
import torch
from model import GPT, GPTConfig
from models import build, tiny_gpt

from zerocc.compiler.capture import ModelInfo, ParamInfo, describe_model
from zerocc.compiler.passes.partition import assign_units
from zerocc.errors import PlanError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "gpt"


def units_of(model, world=2, classes=(), modules=(), min_mb=None):
    units = assign_units(describe_model(model), world, list(classes), list(modules), min_mb)
    return {u.name: [p.fqn for p in u.params] for u in units}, units


def test_tied_weight_lands_in_the_common_ancestor_unit():
    names, _ = units_of(tiny_gpt(), classes=["Block"])
    assert "transformer.wte.weight" in names["root"]  # also lm_head.weight: one tensor
    assert list(names) == ["root", "transformer.h.0", "transformer.h.1"]
    _, units = units_of(tiny_gpt(), classes=["Block"])
    root = next(u for u in units if u.name == "root")
    tied = next(p for p in root.params if p.fqn == "transformer.wte.weight")
    assert tied.param.aliases == ("transformer.wte.weight", "lm_head.weight")


def test_tied_weight_split_across_unit_roots_goes_up():
    names, _ = units_of(tiny_gpt(), modules=["transformer.wte", "lm_head"])
    assert "transformer.wte.weight" in names["root"]
    assert "transformer.wte" not in names and "lm_head" not in names  # nothing else in them


def test_frozen_parameters_form_their_own_unit():
    names, units = units_of(build("frozen"), modules=["backbone", "adapter"])
    assert names["backbone[frozen]"] == [
        "backbone.0.weight",
        "backbone.0.bias",
        "backbone.2.weight",
        "backbone.2.bias",
    ]
    assert not next(u for u in units if u.name == "backbone[frozen]").trainable
    assert names["adapter"] == ["adapter.weight", "adapter.bias"]


def test_size_threshold_wraps_bottom_up():
    # Each Block of the tiny GPT holds 3,280 fp32 elements = 12.8 KiB.
    names, _ = units_of(tiny_gpt(), min_mb=12 / 1024)
    assert "transformer.h.0" in names and "transformer.h.1" in names
    names, _ = units_of(tiny_gpt(), min_mb=1000)
    assert list(names) == ["root"]


def test_blocks_are_grouped_k_to_a_unit_in_model_order():
    """``units.blocks_per_unit``: 5 blocks 2 to a unit are 0-1, 2-3 and 4 alone; a nested
    unit root keeps its own parameters; the root unit is never grouped."""
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=5, n_head=2, n_embd=16))
    info = describe_model(model)
    units = assign_units(info, 2, ["Block", "MLP"], [], None, blocks_per_unit=2)
    by_name = {u.name: u for u in units}
    blocks = ["transformer.h.0-1", "transformer.h.2-3", "transformer.h.4"]
    assert [n for n in by_name if n.startswith("transformer.h.") and "mlp" not in n] == blocks
    assert by_name["transformer.h.0-1"].roots == ("transformer.h.0", "transformer.h.1")
    assert by_name["transformer.h.4"].roots == ("transformer.h.4",)
    assert by_name["root"].roots == ("",)
    held = {p.fqn for p in by_name["transformer.h.0-1"].params}
    assert "transformer.h.1.attn.c_attn.weight" in held and not any(".mlp." in f for f in held)
    # the MLPs, one class under each block (their parents differ): each its own unit
    assert by_name["transformer.h.0.mlp"].roots == ("transformer.h.0.mlp",)
    assert sum(u.numel for u in units) == sum(p.numel for p in info.params)


def test_blocks_per_unit_that_would_group_nothing_is_a_plan_error():
    """No two units of one class under one parent (only the root, or units of other kinds):
    the option would do nothing, said."""
    info = describe_model(tiny_gpt())
    with pytest.raises(PlanError, match=r"blocks_per_unit: 2 groups .*\(the root unit alone\)"):
        assign_units(info, 2, [], [], None, blocks_per_unit=2)
    with pytest.raises(PlanError, match=r"no two units are \(lm_head, transformer.wte\)"):
        assign_units(info, 2, [], ["transformer.wte", "lm_head"], None, blocks_per_unit=2)


def test_a_unit_of_two_blocks_is_gathered_and_reduced_once():
    """At stage 3 the example GPT's 4 blocks 2 to a unit: half the blocks' gathers and
    reduce-scatters, recompute of every unit kept (each block's calls)."""
    from zerocc.compiler.plan import load_plan
    from zerocc.inspect.estimate import inspect_plan
    from zerocc.ir.nodes import info as record
    from zerocc.ir.nodes import op_name

    def collectives(k: int) -> dict[str, int]:
        plan = load_plan({
            "workload": f"{EXAMPLES / 'workload.py'}:workload",
            "workload_args": {"n_layer": 4, "n_embd": 32, "n_head": 2, "block_size": 16,
                              "batch_size": 2},
            "units": {"classes": ["Block"], "blocks_per_unit": k}, "zero": {"stage": 3},
            "recompute": {"units": "all"},
        })  # fmt: skip
        program = inspect_plan(plan, 2).programs[True]
        counts: dict[str, int] = {}
        for node in program.gm.graph.nodes:
            name = op_name(node.target) if node.op == "call_function" else ""
            if name in ("zerocc.all_gather_start", "zerocc.reduce_scatter_start"):
                key = f"{name} {record(node).unit}"
                counts[key] = counts.get(key, 0) + 1
        return counts

    one, two = collectives(1), collectives(2)
    for kind in ("zerocc.all_gather_start", "zerocc.reduce_scatter_start"):
        assert two[f"{kind} transformer.h.0-1"] == one[f"{kind} transformer.h.0"] > 0
        assert two[f"{kind} transformer.h.2-3"] == one[f"{kind} transformer.h.2"]
    def blocks(counts: dict[str, int]) -> int:
        return sum(v for k, v in counts.items() if not k.endswith("root"))

    assert blocks(two) * 2 == blocks(one)  # (the root unit's alike)
    assert {k: v for k, v in two.items() if k.endswith("root")} == {
        k: v for k, v in one.items() if k.endswith("root")
    }
    assert not any(k.endswith(("transformer.h.1", "transformer.h.3")) for k in two)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_flat_layout_is_padded_to_the_world_size(world):
    _, units = units_of(build("odd"), world=world, modules=["a", "b"])
    for u in units:
        assert u.padded_numel % world == 0 and 0 <= u.padded_numel - u.numel < world
        assert u.shard_numel * world == u.padded_numel


def _layers(n: int) -> ModelInfo:
    """A ModelInfo of ``n`` blocks of 3 parameters each, in a deep path (``model.layers.i``)."""

    def param(fqn: str) -> ParamInfo:
        return ParamInfo(fqn, (fqn,), (4, 4), torch.float32, True)

    modules = [("", "Net"), ("model", "Body"), ("model.layers", "ModuleList")]
    params = [param("model.embed.weight")]
    for i in range(n):
        modules += [(f"model.layers.{i}", "Block"), (f"model.layers.{i}.mlp", "Mlp")]
        params += [param(f"model.layers.{i}.mlp.{w}") for w in ("up", "gate", "down")]
    return ModelInfo(tuple(params), (), tuple(modules))


def _python_calls(n: int) -> int:
    profile = cProfile.Profile()
    profile.runcall(assign_units, _layers(n), 2, ["auto"], [], None)
    return pstats.Stats(profile).total_calls


def test_units_of_a_deep_model_take_work_linear_in_its_depth():
    """``units: auto`` on 4000 layers took minutes: finding the repeated block summed every
    parameter for every module, and each parameter's unit scanned every unit root. Python
    calls, counted (deterministic), grow with the layers, not their square."""
    units = assign_units(_layers(300), 2, ["auto"], [], None)
    assert [u.name for u in units][:2] == ["root", "model.layers.0"] and len(units) == 301
    assert _python_calls(400) <= 2.1 * _python_calls(200)
