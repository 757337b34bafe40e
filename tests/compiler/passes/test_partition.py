"""partition: which parameters land in which unit."""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
from models import build, tiny_gpt

from zerocc.compiler.capture import ModelInfo, ParamInfo, describe_model
from zerocc.compiler.passes.partition import assign_units


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
