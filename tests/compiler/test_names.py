"""Globs over dotted names: '*' stops at dots, '**' crosses them (issue 20: the README's own
`units.modules: ["transformer.h.*"]` once split GPT-2 into a unit per submodule)."""

from __future__ import annotations

import pytest

import zerocc
from zerocc.compiler.names import glob_matches

CASES = [
    ("transformer.h.0", "transformer.h.*", True),
    ("transformer.h.0.attn", "transformer.h.*", False),
    ("transformer.h.0.attn", "transformer.h.**", True),
    ("transformer.h.0", "transformer.h.**", True),
    ("transformer.h.3", "transformer.h.[0-3]", True),
    ("transformer.h.12", "transformer.h.[0-3]", False),
    ("transformer.h.1", "transformer.h.[!0]", True),
    ("transformer.h.0", "transformer.h.[!0]", False),
    ("h.1", "h.?", True),
    ("h.10", "h.?", False),
    ("a.b.c", "**.c", True),
    ("a.b.c", "*.c", False),
    ("model.layers.5.mlp", "*.layers.*.mlp", True),
    ("x[y", "x[y", True),  # an unclosed bracket is literal
]


@pytest.mark.parametrize(("name", "pattern", "expected"), CASES)
def test_star_stops_at_dots(name, pattern, expected):
    assert glob_matches(name, pattern) is expected


def test_units_modules_star_gives_one_unit_per_block():
    from workload import workload

    model = workload(n_layer=3, n_embd=32, n_head=2, block_size=16).model
    plan = {"zero": {"stage": 3}, "units": {"modules": ["transformer.h.*"]}}
    step = zerocc.compile(model, plan, comm=zerocc.FakeComm(world_size=2))
    assert sorted(u.key for u in step.units) == [
        "root",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
    ]
