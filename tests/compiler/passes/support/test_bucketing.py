"""Bucketing (zerocc/compiler/passes/support/bucketing.py, run by the overlap pass): small
collectives merged into buckets of about ``overlap.bucket_mb``, moving the same bytes in fewer
calls."""

from __future__ import annotations

import pytest

import zerocc
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name


def _collectives(stage: int, bucket_mb: float) -> dict[str, list[int]]:
    plan = {
        "workload": "workload:workload",
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "overlap": {"bucket_mb": bucket_mb},
    }
    gm = inspect_plan(zerocc.load_plan(plan), 4).stepping.gm
    out: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        name = op_name(node.target)
        if name.endswith("_start") and info(node).phase in ("forward", "backward"):
            out.setdefault(name, []).append(info(node).bytes)
    return out


@pytest.mark.parametrize(
    "stage, kinds",
    [
        (3, ["zerocc.all_gather_start", "zerocc.reduce_scatter_start"]),
        (2, ["zerocc.reduce_scatter_start"]),
        (0, ["zerocc.all_reduce_start"]),
    ],
)
def test_buckets_move_the_same_bytes_in_fewer_collectives(stage, kinds):
    apart, bucketed = _collectives(stage, 0), _collectives(stage, 64)
    for kind in kinds:
        assert len(bucketed[kind]) < len(apart[kind])
        assert sum(bucketed[kind]) == sum(apart[kind])
