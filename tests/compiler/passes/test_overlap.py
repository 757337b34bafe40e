"""Graph-level tests of the overlap pass, on a fake process group (no ranks)."""

from __future__ import annotations

import pytest
from models import tiny_gpt
from parity import batch_of

import zerocc
from zerocc.compiler.driver.pass_manager import check_passes
from zerocc.compiler.passes.overlap import inflight_peak
from zerocc.compiler.workload import Workload
from zerocc.errors import PassOrderError, PlanError
from zerocc.inspect.estimate import estimate, inspect_plan
from zerocc.ir.nodes import info, op_name

MB = 2**20


def program(stage: int = 3, overlap: dict | None = None, units: dict | None = None, **plan):
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"], **(units or {})},
        "optimizer": {"grad_clip": 1.0},
        "overlap": overlap or {},
        **plan,
    }
    step = zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(4))
    step(*batch_of({"model": "gpt"}, 0, 0))
    return step.program


def calls(gm, name: str) -> list:
    return [n for n in gm.graph.nodes if op_name(n.target) == f"zerocc.{name}"]


def gathers(gm) -> list:
    return [n for n in calls(gm, "all_gather_start") if info(n).phase != "optimizer"]


def in_flight_at_compute(gm) -> list[int]:
    """At each compute node, how many parameter gathers are issued and not yet waited on."""
    pending, counts = set(), []
    for n in gm.graph.nodes:
        if n in gathers(gm):
            pending.add(n)
        elif op_name(n.target) == "zerocc.wait":
            pending.discard(n.args[0])
        elif n.op == "call_function" and info(n).stream == "compute":
            counts.append(len(pending))
    return counts


def compute_order(gm) -> list[str]:
    """Compute nodes in program order, without the ones the pass may move (accumulations of
    reduced gradients and views of collective results)."""
    moved = {"aten.add_", "aten.slice"}
    return [
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function" and info(n).stream == "compute"
        and op_name(n.target) not in moved
    ]  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_never_reorders_compute(stage):
    assert compute_order(program(stage)) == compute_order(program(stage, {"enabled": False}))


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_bounds_the_gathers_ahead_of_compute(prefetch):
    counts = in_flight_at_compute(program(overlap={"prefetch": prefetch}))
    assert max(counts) == prefetch


def test_prefetch_zero_and_overlap_off_gather_just_in_time():
    for overlap in ({"prefetch": 0}, {"enabled": False}):
        assert max(in_flight_at_compute(program(overlap=overlap))) == 0


def test_reduce_scatters_are_waited_on_after_later_compute():
    gm = program()
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    computed = set(compute_order(gm))
    scatters = calls(gm, "reduce_scatter_start")
    for start in scatters[:-1]:
        (wait,) = start.users
        between = nodes[at[start] + 1 : at[wait]]
        assert any(n.name in computed for n in between), start.name


def test_budget_bounds_the_bytes_in_flight():
    unbounded = program()
    unit = max(info(n).bytes for n in gathers(unbounded))
    assert inflight_peak(unbounded) > 1.5 * unit
    budget = 1.5 * unit
    bounded = program(overlap={"max_inflight_mb": budget / MB, "prefetch": 3})
    assert 0 < inflight_peak(bounded) <= budget
    tiny = program(overlap={"max_inflight_mb": 1e-6})
    assert max(in_flight_at_compute(tiny)) == 0


def _workload() -> Workload:
    return Workload(
        tiny_gpt(), batches=lambda rank, world: iter([batch_of({"model": "gpt"}, 0, 0)])
    )


def test_predicted_peak_grows_by_at_most_the_budget():
    workload = _workload()
    plan = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}}
    peaks = {}
    for name, overlap in {"off": {"enabled": False}, "on": {"max_inflight_mb": 0.1}}.items():
        peaks[name] = estimate(inspect_plan({**plan, "overlap": overlap}, 4, workload)).peak
    assert peaks["off"]["total"] < peaks["on"]["total"] <= peaks["off"]["total"] + 0.1 * MB


def test_buckets_gather_and_reduce_small_units_together():
    plain, bucketed = program(), program(overlap={"bucket_mb": 1})
    assert len(gathers(bucketed)) == 2  # one bucket per phase: every unit is small
    assert len(calls(bucketed, "reduce_scatter_start")) == 1
    for name in ("all_gather_start", "reduce_scatter_start"):
        moved = [sum(info(n).bytes for n in calls(gm, name)) for gm in (plain, bucketed)]
        assert moved[0] == moved[1], name


@pytest.mark.parametrize("stage, name", [(0, "all_reduce_start"), (1, "reduce_scatter_start")])
def test_buckets_reduce_stage_0_and_1_gradients_together(stage, name):
    def reductions(gm):
        return [n for n in calls(gm, name) if info(n).phase == "backward"]

    plain, bucketed = program(stage), program(stage, {"bucket_mb": 1})
    assert len(reductions(plain)) == 3 and len(reductions(bucketed)) == 1
    moved = [sum(info(n).bytes for n in reductions(gm)) for gm in (plain, bucketed)]
    assert moved[0] == moved[1]


def test_moved_collectives_say_why_in_the_program():
    notes = [info(n).note or "" for n in program().graph.nodes]
    assert any("prefetched: issued right after" in note for note in notes)
    assert any("waited on late: right before" in note for note in notes)


def test_units_copied_out_of_a_bucket_count_as_gathered():
    overlap = {"bucket_mb": 1, "prefetch": 0}  # one bucket in flight at a time
    plan = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "overlap": overlap}
    gm = program(overlap=overlap)
    forward = [n for n in gathers(gm) if info(n).phase == "forward"]
    units = sum(info(n).bytes for n in forward)  # every unit, in one bucket
    peak = estimate(inspect_plan(plan, 4, _workload())).peak
    assert peak["gathered"] >= 2 * units  # the bucket and its copies, before it is freed


def test_a_bucket_stops_at_its_size():
    unit = max(info(n).bytes for n in gathers(program()))
    gm = program(overlap={"bucket_mb": 1.5 * unit / MB})
    assert 2 < len(gathers(gm)) < 2 * 3


def test_kept_units_are_gathered_once_per_step():
    gm = program(units={"keep_gathered": ["root", "transformer.h.0"]})
    units = [info(n).unit for n in gathers(gm)]
    assert units.count("root") == 1 and units.count("transformer.h.0") == 1
    assert units.count("transformer.h.1") == 2
    small = program(units={"keep_gathered_below_mb": 1})
    assert len(gathers(small)) == 3  # every unit is below 1 MB: one gather each


def test_keep_gathered_errors_name_the_fix():
    with pytest.raises(PlanError, match="matches no unit; units are: root"):
        program(units={"keep_gathered": ["h.*"]})
    with pytest.raises(PlanError, match="stage 3 only"):
        zerocc.load_plan({"zero": {"stage": 2}, "units": {"keep_gathered": ["root"]}})
    with pytest.raises(PlanError, match="overlap.enabled is false"):
        check_passes(
            zerocc.load_plan({"overlap": {"enabled": False}, "passes": ["partition", "overlap"]})
        )


def test_overlap_runs_after_the_optimizer():
    with pytest.raises(PassOrderError, match="overlap"):
        program(passes=["partition", "shard", "overlap", "optimizer"])
