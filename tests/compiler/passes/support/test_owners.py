"""Muon's groups and owners (zerocc/compiler/passes/support/owners.py): which parameters take
Muon by default and by glob, and owners balanced by the Newton-Schulz cost."""

from __future__ import annotations

import pytest
import torch

from zerocc.compiler.capture import ModelInfo, ParamInfo
from zerocc.compiler.passes.support.owners import (
    assign_owners,
    muon_params,
    newton_schulz_cost,
    owned_matrices,
)
from zerocc.compiler.units import Unit
from zerocc.errors import PlanError


def _param(fqn: str, shape: tuple[int, ...], *aliases: str) -> ParamInfo:
    return ParamInfo(fqn, (fqn, *aliases), shape, torch.float32, True)


GPT = ModelInfo(
    params=(
        _param("transformer.wte.weight", (32, 16), "lm_head.weight"),
        _param("transformer.wpe.weight", (8, 16)),
        _param("transformer.h.0.ln_1.weight", (16,)),
        _param("transformer.h.0.attn.c_attn.weight", (48, 16)),
        _param("transformer.h.0.attn.c_attn.bias", (48,)),
        _param("transformer.h.0.mlp.c_fc.weight", (64, 16)),
        _param("head.weight", (5, 16)),
    ),
    buffers=(),
    modules=(("transformer.wte", "Embedding"), ("transformer.wpe", "Embedding")),
)


def test_cost_is_rows_cols_min():
    assert newton_schulz_cost((64, 16)) == 64 * 16 * 16
    assert newton_schulz_cost((3, 8, 20)) == 3 * 8 * 20 * 8


def test_owners_balance_the_cost():
    shapes = {"a": (64, 64), "b": (64, 32), "c": (64, 32), "d": (32, 32), "e": (8, 8)}
    owners = assign_owners(shapes, 2)
    # largest first to the least loaded: a -> 0, b -> 1, c -> 1, d -> 1, e -> 1
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 1, "e": 1}
    load = [sum(newton_schulz_cost(shapes[n]) for n, r in owners.items() if r == k) for k in (0, 1)]
    assert load == [64**3, 2 * 64 * 32 * 32 + 32**3 + 8**3]  # a alone outweighs the rest
    assert set(assign_owners(shapes, 8).values()) == {0, 1, 2, 3, 4}  # one each, 3 idle
    assert assign_owners(shapes, 1) == dict.fromkeys(shapes, 0)
    with pytest.raises(ValueError):
        assign_owners(shapes, 0)


def test_default_groups_are_moonlights():
    assert muon_params(GPT, []) == {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.mlp.c_fc.weight",
    }


def test_groups_by_glob_first_match_decides():
    groups = [(["**.mlp.*"], "adamw"), (["**"], "muon")]
    with pytest.raises(PlanError, match=r"transformer.h.0.ln_1.weight \(shape \[16\]\)"):
        muon_params(GPT, groups)
    groups = [(["**.mlp.**", "**bias", "**ln_*.*"], "adamw"), (["**"], "muon")]
    chosen = muon_params(GPT, groups)
    assert "transformer.h.0.mlp.c_fc.weight" not in chosen
    assert "transformer.wte.weight" in chosen  # a group overrides the default
    assert "head.weight" in chosen


def test_owned_matrices_lie_in_their_units():
    info = [p for p in GPT.params if p.fqn.startswith("transformer.h.0")]
    unit = Unit.build("transformer.h.0", info, 2)
    matrices = owned_matrices([unit], muon_params(GPT, []), 2)["transformer.h.0"]
    assert [(m.fqn, m.offset, m.owner) for m in matrices] == [
        ("transformer.h.0.attn.c_attn.weight", 16, 1),
        ("transformer.h.0.mlp.c_fc.weight", 16 + 48 * 16 + 48, 0),
    ]
