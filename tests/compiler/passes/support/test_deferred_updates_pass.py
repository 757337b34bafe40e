"""offload.defer_updates, graph-level (zerocc/compiler/passes/support/deferred_updates.py):
where the carried updates, their waits and their compute copies go. (Numbers:
tests/runtime/test_deferred_updates.py, tests/parity.)"""

from __future__ import annotations

import pytest
from torch import fx

import zerocc
from zerocc.compiler.passes.support.deferred_updates import carried_program
from zerocc.cost.simulate import simulate
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.access import StorageRoots
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import PARAM_FULL, PARAM_SHARD, info, op_kind, op_name


def _program(deferral: str, stage: int = 3, world_size: int = 2) -> fx.GraphModule:
    plan = zerocc.load_plan(
        {
            "workload": "workload:workload",
            "workload_args": {"n_layer": 3},
            "zero": {"stage": stage},
            "units": {"classes": ["Block"]},
            "precision": {"param": "bf16"},
            "optimizer": {"name": "adamw", "grad_clip": 1.0},
            "offload": {"optimizer": "cpu", "defer_updates": deferral},
        }
    )
    return inspect_plan(plan, world_size).stepping.gm


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


def _reads(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Per unit, the nodes of the step (not carried) that read its weights (stages 1-2: the
    whole, of which the shard is a view; stage 3: the shard), through any view of them, in
    program order."""
    roots = StorageRoots(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights = {}
    for role in (PARAM_SHARD, PARAM_FULL):
        weights.update({info(n).unit: n for n in placeholders if info(n).role == role})
    return {
        unit: [
            n
            for n in gm.graph.nodes
            if not info(n).carried and n.op != "output" and w in roots.access(n).reads
        ]
        for unit, w in weights.items()
    }


def test_stages_1_2_next_forward_gathers_each_update_a_unit_ahead_of_its_first_read():
    """The whole weights of every rank: each carried update's copy, then the all-gather of the
    copied shards, started before the unit before it is first read, waited for before the
    unit's own first read; none left at the step's end."""
    gm = _program("next_forward", stage=2)
    units, reads = _Units(gm), _reads(gm)
    gathers = {info(n).unit: n for n in _nodes(gm, "all_gather_into_start")}
    first = sorted(units.updates, key=lambda u: units.order[reads[u][0]])
    for before, unit in zip([None, *first], first, strict=False):
        gather = gathers[unit]
        gather_wait = next(iter(gather.users))
        assert info(gather).carried and info(gather_wait).carried
        assert units.before(
            units.host_wait[unit], units.back[unit], units.back_wait[unit], gather, gather_wait
        )
        assert units.before(gather_wait, reads[unit][0])
        if before is not None:
            assert units.before(gather, reads[before][0])


def test_stages_1_2_delayed_copies_each_shard_after_the_last_read_of_the_weights():
    """The copy writes this rank's part of the weights the step computes on (a view of
    them): after the step's last read of them, in backward; its all-gather follows."""
    gm = _program("delayed", stage=2)
    units, reads = _Units(gm), _reads(gm)
    gathers = {info(n).unit: n for n in _nodes(gm, "all_gather_into_start")}
    for unit in units.updates:
        assert info(reads[unit][-1]).phase == "backward"
        assert units.before(reads[unit][-1], units.back[unit], units.back_wait[unit])
        assert units.before(units.back_wait[unit], gathers[unit], next(iter(gathers[unit].users)))


@pytest.mark.parametrize("stage", [2, 3])
def test_on_one_rank_the_carried_copy_writes_the_weights_before_their_first_read(stage):
    """No all-gather: the copy writes the tensor the step reads (stages 1-2: the whole, not
    the shard that aliases it), so that it is ordered before the reads by data."""
    gm = _program("next_forward", stage=stage, world_size=1)
    units, reads = _Units(gm), _reads(gm)
    assert not _nodes(gm, "all_gather_into_start")
    for unit in units.updates:
        assert units.back[unit].args[0] in {n.args[0] for n in reads[unit]} | set(reads[unit])
        assert units.before(units.back_wait[unit], reads[unit][0])


@pytest.mark.parametrize("deferral", ["next_forward", "delayed"])
@pytest.mark.parametrize("stage", [2, 3])
def test_the_carried_nodes_alone_apply_the_pending_update(deferral, stage):
    """What a save or an evaluation runs first: the updates, their waits and compute copies;
    no collective under stage 3 (each rank writes its shard), the all-gathers of the updated
    shards under stages 1-2 (a collective: every caller of the drain is one)."""
    gm = _program(deferral, stage)
    drain = carried_program(gm)
    ops = {op_name(n.target) for n in drain.graph.nodes if n.op == "call_function"}
    collectives = [n for n in drain.graph.nodes if op_kind(n) is OpKind.COLLECTIVE]
    updates = _nodes(gm, "adamw_")
    assert len(collectives) == (len(updates) if stage < 3 else 0)
    assert all(op_name(n.target) == "zerocc.all_gather_into_start" for n in collectives)
    assert {"zerocc.adamw_", "zerocc.host_wait", "zerocc.copy_into_start", "zerocc.wait"} <= ops
    assert len(_nodes(drain, "adamw_")) == len(updates)
    assert carried_program(_program("none", stage)) is None


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
