"""The offload pass (zerocc/compiler/passes/offload.py), graph-level: the units ``offload.ratio``
places off the device have their optimizer states read from and written back to NVMe around
their update, and no other unit does. (Parity and measured bytes: tests/runtime/test_offload.py,
tests/parity.)"""

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


@pytest.mark.parametrize("stage", [2, 3])
def test_host_updates_write_compute_copies_into_two_host_buffers_in_turn(stage):
    """bf16 parameters on the device, fp32 masters on the host: each host update writes its
    compute copy into a view of one of two host buffers, in turn; the device copy is copied
    from that view (same dtype); and the copy that read a buffer is waited on before the update
    after next writes it again."""
    plan = zerocc.load_plan(
        {
            "workload": "workload:workload",
            "zero": {"stage": stage},
            "units": {"classes": ["Block"]},
            "precision": {"param": "bf16"},
            "offload": {"optimizer": "cpu"},
        }
    )
    gm = inspect_plan(plan, 2).stepping.gm
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    buffers = [n for n in nodes if op_name(n.target) == "zerocc.host_buffer"]
    assert len(buffers) == 2 and all(str(b.meta["val"].dtype) == "torch.bfloat16" for b in buffers)
    updates = [n for n in nodes if op_name(n.target) == "zerocc.adamw_"]
    assert len(updates) >= 3
    copies = [n for n in nodes if op_name(n.target) == "zerocc.copy_into_start"]
    for i, update in enumerate(updates):
        staged = update.args[7]  # param_copy: a view of buffer i % 2
        assert staged.args[0] is buffers[i % 2], update.name
        (copy,) = [c for c in copies if c.args[1] is staged]
        assert copy.args[0].meta["val"].dtype == staged.meta["val"].dtype  # no cast on the way
        (wait,) = copy.users
        if i + 2 < len(updates):
            assert order[wait] < order[updates[i + 2]], (wait.name, updates[i + 2].name)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_kept_on_the_device_go_through_two_host_buffers_one_update_ahead(stage):
    """offload.grads: device: no gradient is copied during backward; each offloaded update
    reads its gradient from a view of one of two fp32 host buffers, in turn, copied in on the
    copy stream after the update two before it (the last one to read that buffer) and issued
    before the update before it, so that copy and update overlap; waited for right before."""
    plan = zerocc.load_plan(
        {
            "workload": "workload:workload",
            "zero": {"stage": stage},
            "units": {"classes": ["Block"]},
            "precision": {"param": "bf16"},
            "optimizer": {"grad_clip": 1.0},
            "offload": {"optimizer": "cpu", "grads": "device"},
        }
    )
    gm = inspect_plan(plan, 2).stepping.gm
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    buffers = [n for n in nodes if op_name(n.target) == "zerocc.host_buffer"]
    grad_buffers = [b for b in buffers if b.args[2].startswith("offload.grads.")]
    assert len(grad_buffers) == 2
    assert all(str(b.meta["val"].dtype) == "torch.float32" for b in grad_buffers)
    copies = ("zerocc.copy_start", "zerocc.copy_into_start")
    in_backward = [n for n in nodes if op_name(n.target) in copies and info(n).phase == "backward"]
    assert not in_backward  # nothing leaves the device during backward
    updates = [n for n in nodes if op_name(n.target) == "zerocc.adamw_"]
    assert len(updates) >= 3
    for i, update in enumerate(updates):
        wait = update.args[1]
        copy = wait.args[0]
        assert op_name(wait.target) == "zerocc.wait" and order[wait] < order[update]
        assert op_name(copy.target) == "zerocc.copy_into_start"
        assert copy.args[0].args[0] is grad_buffers[i % 2], update.name
        assert copy.args[1].meta["val"].device.type == "cpu"  # (the inspection's device)
        if i >= 1:
            assert order[copy] < order[updates[i - 1]], (copy.name, updates[i - 1].name)
        if i >= 2:
            assert order[updates[i - 2]] < order[copy], (updates[i - 2].name, copy.name)
