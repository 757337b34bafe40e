"""The offload pass (passes/offload.py), graph-level: the units ``offload.ratio`` places off
the device have their optimizer states read from and written back to NVMe around their update,
and no other unit does. (Parity and measured bytes: tests/test_offload.py, tests/parity.)"""

from __future__ import annotations

import pytest

import zerocc
from zerocc.compiler.state import placements
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_nvme_states_are_read_and_written_for_the_offloaded_units_only(tmp_path, ratio):
    plan = zerocc.load_plan(
        {
            "workload": "workload:workload",
            "zero": {"stage": 2},
            "units": {"classes": ["Block"]},
            "offload": {"optimizer": "nvme", "nvme_path": str(tmp_path), "ratio": ratio},
        }
    )
    inspection = inspect_plan(plan, 2)
    offloaded = {u for u, p in placements(inspection.units, plan.offload).items() if p.offloaded}
    assert offloaded and (ratio == 1.0) == (len(offloaded) == len(inspection.units))
    gm = inspection.stepping.gm

    def units_of(name: str) -> set[str]:
        return {info(n).unit for n in gm.graph.nodes if op_name(n.target) == f"zerocc.{name}"}

    assert units_of("nvme_read_start") == units_of("nvme_write_start") == offloaded
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for update in (n for n in gm.graph.nodes if op_name(n.target) == "zerocc.adamw_"):
        if info(update).unit in offloaded:
            reads = [
                n
                for n in gm.graph.nodes
                if op_name(n.target) == "zerocc.nvme_read_start"
                and info(n).unit == info(update).unit
            ]
            assert all(order[r] < order[update] for r in reads)
