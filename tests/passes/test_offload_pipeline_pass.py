"""offload.pipeline, graph-level (passes/offload_pipeline.py): where the carried updates, their
waits and their compute copies go. (Numbers: tests/test_offload_pipeline.py, tests/parity.)"""

from __future__ import annotations

import pytest
from torch import fx

import zerocc
from zerocc.cost.simulate import simulate
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import info, op_kind, op_name
from zerocc.passes.offload_pipeline import carried_program


def _program(pipeline: str) -> fx.GraphModule:
    plan = zerocc.load_plan(
        {
            "workload": "workload:workload",
            "workload_args": {"n_layer": 3},
            "zero": {"stage": 3},
            "units": {"classes": ["Block"]},
            "precision": {"param": "bf16"},
            "optimizer": {"name": "adamw", "grad_clip": 1.0},
            "offload": {"optimizer": "cpu", "pipeline": pipeline},
        }
    )
    return inspect_plan(plan, 2).stepping.gm


def _nodes(gm: fx.GraphModule, op: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if op_name(n.target) == f"zerocc.{op}"]


class _Units:
    """Per unit: its carried update, the update's wait, its compute copy (start and wait), the
    copy that fills its gradient buffer for the next step, and its gathers."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.updates = {info(n).unit: n for n in _nodes(gm, "adamw_")}
        waits = {n.args[1]: n for n in _nodes(gm, "host_wait")}
        self.host_wait = {u: waits[n.name] for u, n in self.updates.items()}
        self.back = {u: next(iter(w.users)) for u, w in self.host_wait.items()}
        self.back_wait = {u: next(iter(b.users)) for u, b in self.back.items()}
        self.fill = {
            u: next(n for n in _nodes(gm, "copy_into_start") if n.args[0] is update.args[1])
            for u, update in self.updates.items()
        }
        self.gathers: dict[str, list[fx.Node]] = {}
        for n in _nodes(gm, "all_gather_start"):
            self.gathers.setdefault(info(n).unit, []).append(n)

    def before(self, *nodes: fx.Node) -> bool:
        return all(self.order[a] < self.order[b] for a, b in zip(nodes, nodes[1:], strict=False))


def test_next_forward_waits_for_each_update_right_before_the_units_first_gather():
    gm = _program("next_forward")
    units = _Units(gm)
    assert len(units.updates) == 4  # the root and three blocks, every one offloaded
    for unit, update in units.updates.items():
        assert info(update).carried and info(update).stream == Stream.HOST
        first_gather = units.gathers[unit][0]
        assert units.before(
            update, units.host_wait[unit], units.back[unit], units.back_wait[unit], first_gather
        )
        assert units.back[unit].args[1] is units.host_wait[unit]  # the copy reads the waited
        assert units.before(units.host_wait[unit], units.fill[unit])  # before its buffer refills
    # Issued in the order forward gathers the units.
    by_gather = sorted(units.updates, key=lambda u: units.order[units.gathers[u][0]])
    assert sorted(units.updates, key=lambda u: units.order[units.updates[u]]) == by_gather
    # Two host buffers in turn: an update comes after the copy that last read its buffer.
    last_read: dict[fx.Node, fx.Node] = {}
    for unit in by_gather:
        view = units.updates[unit].args[7]
        slot = view.args[0]
        if slot in last_read:
            assert units.before(last_read[slot], units.updates[unit])
        last_read[slot] = units.back_wait[unit]
    assert len(last_read) == 2


def test_delayed_writes_each_compute_copy_after_the_units_last_gather():
    gm = _program("delayed")
    units = _Units(gm)
    waits = {n.args[0]: n for n in _nodes(gm, "wait")}
    for unit in units.updates:
        last_gather_done = waits[units.gathers[unit][-1]]
        assert units.before(units.host_wait[unit], units.fill[unit])
        assert units.before(last_gather_done, units.back[unit])
        assert units.updates[unit].args[7].args[0].args[2] == f"offload.carried.copy.{unit}"
    # Issued at the start, in the order backward refills the units' gradient buffers.
    first_compute = next(
        n for n in gm.graph.nodes if n.op == "call_function" and info(n).phase == "forward"
    )
    assert all(units.before(u, first_compute) for u in units.updates.values())
    by_fill = sorted(units.updates, key=lambda u: units.order[units.fill[u]])
    assert sorted(units.updates, key=lambda u: units.order[units.updates[u]]) == by_fill


@pytest.mark.parametrize("pipeline", ["next_forward", "delayed"])
def test_the_carried_nodes_alone_apply_the_pending_update(pipeline):
    """What a save or an evaluation runs first: the updates, their waits and compute copies,
    and no collective (a rank may run it alone)."""
    gm = _program(pipeline)
    drain = carried_program(gm)
    ops = {op_name(n.target) for n in drain.graph.nodes if n.op == "call_function"}
    assert not any(op_kind(n) is OpKind.COLLECTIVE for n in drain.graph.nodes)
    assert {"zerocc.adamw_", "zerocc.host_wait", "zerocc.copy_into_start", "zerocc.wait"} <= ops
    assert len(_nodes(drain, "adamw_")) == len(_nodes(gm, "adamw_"))
    assert carried_program(_program("none")) is None


def test_the_simulation_runs_carried_updates_beside_compute():
    """Updates of 10 ms against 0.1 ms per compute op: the plain step adds them up; carried,
    they run on the host track while forward (next_forward) or the whole step (delayed)
    computes, and the step waits only for what is not done."""

    def cost(node: fx.Node) -> float:
        if op_name(node.target) == "zerocc.adamw_":
            return 0.01
        return 1e-4 if op_kind(node) is OpKind.COMPUTE else 0.0

    runs = {mode: simulate(_program(mode), cost) for mode in ("none", "next_forward", "delayed")}
    compute = sum(cost(n) for n in _program("none").graph.nodes if n.op == "call_function")
    assert runs["none"].step_s == pytest.approx(compute)  # the updates hold the compute stream
    assert runs["none"].host_waited_s == 0
    for mode in ("next_forward", "delayed"):
        run = runs[mode]
        assert run.host_s == pytest.approx(0.04)
        assert run.step_s == pytest.approx(run.compute_s + run.host_waited_s)
        host = [e for e in run.events if e.track == "host"]
        assert len(host) == 4 and host[0].start_us == 0  # issued at the program's start
    # Delayed waits for the updates last (in backward), so it overlaps the most.
    assert runs["delayed"].step_s < runs["next_forward"].step_s < runs["none"].step_s
