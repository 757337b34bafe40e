"""partition: which parameters land in which unit."""

from __future__ import annotations

import pytest
from models import build, tiny_gpt

from zerocc.compiler.capture import describe_model
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
