"""Pass manager: contracts, records, and the invariant checks of ZEROCC_VERIFY."""

from __future__ import annotations

import pytest
import torch
from models import tiny_gpt
from parity import batch_of

import zerocc
from zerocc.errors import InvariantError, PlanError
from zerocc.ir.nodes import info, op_name
from zerocc.ir.verify import verify_program


def _step(stage=3):
    plan = {"zero": {"stage": stage}, "units": {"classes": ["Block"]}}
    step = zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(2))
    step(*batch_of({"model": "gpt"}, 0, 0))
    return step


def test_each_pass_is_timed_and_its_graph_kept():
    records = _step().records
    assert [r.name for r in records] == ["capture", "partition", "shard", "optimizer", "overlap"]
    assert records[0].program.startswith("# Captured by make_fx")
    shard = records[2]
    assert shard.seconds > 0 and shard.program.startswith("# Constructed by pass 'shard'")
    assert shard.ops_added["zerocc.all_gather_start"] == 6  # 3 units, forward and backward
    assert records[1].ops_added == {} and records[1].ops_removed == {}  # analysis only
    assert records[3].ops_added["zerocc.adamw_"] == 3


def test_use_after_free_is_caught():
    gm = _step().program
    free = next(n for n in gm.graph.nodes if op_name(n.target) == "zerocc.free")
    first_user = next(u for a in free.args for u in a.users if u is not free)
    first_user.prepend(free)  # free the gathered unit before its first use
    with pytest.raises(InvariantError, match="after it was freed"):
        verify_program(gm, after="test")


def test_a_use_before_its_definition_is_one_line_naming_the_pass():
    """fx's lint message ends with a printout of the whole graph (780 KB for a 7B GPT): the
    error keeps its first line and names the pass."""
    gm = _step().program
    user = next(n for n in gm.graph.nodes if n.op == "call_function" and n.all_input_nodes)
    user.all_input_nodes[0].prepend(user)  # now before what it reads
    with pytest.raises(InvariantError) as failure:
        verify_program(gm, after="recompute")
    message = str(failure.value)
    assert "after pass 'recompute'" in message and "used before it has been defined" in message
    assert "\n" not in message and "graph():" not in message


def test_collective_without_wait_is_caught():
    gm = _step().program
    wait = next(n for n in gm.graph.nodes if op_name(n.target) == "zerocc.wait")
    start = wait.args[0]
    wait.replace_all_uses_with(start)
    gm.graph.erase_node(wait)
    with pytest.raises(InvariantError, match="exactly one wait"):
        verify_program(gm, after="test")


def test_writing_a_tensor_while_its_collective_is_in_flight_is_caught():
    gm = _step(stage=0).program
    start = next(n for n in gm.graph.nodes if op_name(n.target) == "zerocc.all_reduce_start")
    with gm.graph.inserting_after(start):
        gm.graph.call_function(torch.ops.aten.zero_.default, (start.args[0],))
    with pytest.raises(InvariantError, match="while collective"):
        verify_program(gm, after="test")


def test_graph_nodes_carry_units_and_streams():
    gm = _step().program
    comm = [n for n in gm.graph.nodes if info(n).stream == "comm"]
    # All but the all-reduce of every unit's non-finite flag, once per step.
    step_wide = [n for n in comm if not info(n).unit]
    assert comm and [op_name(n.target) for n in step_wide] == [
        "zerocc.all_reduce_start",
        "zerocc.wait",
    ]
    assert op_name(step_wide[0].args[0].target) == "zerocc.nonfinite_flags"


def test_default_pipeline_changes_no_numerics():
    from zerocc.compiler.driver.pass_manager import bind_passes
    from zerocc.compiler.plan import Plan

    specs = bind_passes(Plan()).specs
    assert [s.name for s in specs] == ["partition", "shard", "optimizer", "overlap"]
    assert not any(s.changes_numerics for s in specs)


ORDER = "partition, recompute, shard, precision, optimizer, overlap, offload"
BF16 = {"precision": {"param": "bf16"}}
CPU_OFFLOAD = {"offload": {"optimizer": "cpu"}}


@pytest.mark.parametrize(
    ("passes", "extra", "expected"),
    [
        (["shard", "partition"], {}, "passes[0]: 'shard' requires 'units'"),
        (["partition", "partition", "shard", "optimizer"], {},
         "passes[1]: 'partition' is listed twice (first at passes[0])"),
        (["partition", "shard", "optimizer", "shard"], {}, "passes[3]: 'shard' is listed twice"),
        (["partition", "shard"], {},
         "passes: a training step needs 'optimizer_update' (produced by optimizer)"),
        ([], {}, "passes: a training step needs 'grad_shards'"),
        (["partition", "optimizer"], {},
         "passes[1]: 'optimizer' requires 'grad_shards' (produced by shard)"),
        (["partition", "shard", "optimizer", "precision"], BF16,
         "passes[3]: 'precision' must run before 'optimizer' (passes[2])"),
        (["partition", "shard", "optimizer", "offload", "overlap"], CPU_OFFLOAD,
         "passes[4]: 'overlap' must run before 'offload' (passes[3])"),
        (["partition", "shard", "optimzer"], {},
         "passes[2]: unknown pass 'optimzer' (did you mean 'optimizer'?)"),
    ],
)  # fmt: skip
def test_bad_pass_lists_are_plan_errors_before_capture(passes, extra, expected):
    with pytest.raises(PlanError) as info:
        zerocc.compile(tiny_gpt(), {"passes": passes, **extra}, comm=zerocc.FakeComm(2))
    message = str(info.value)
    assert message.startswith(f"plan: {expected}")
    assert ORDER in message or "twice" in message  # the order the contracts allow, or names
    if message.startswith("plan: passes:"):
        assert "required passes: partition, shard, optimizer" in message


def test_the_order_in_messages_is_the_one_the_contracts_allow():
    from zerocc.compiler.driver.pass_manager import PASSES, check_order

    order = ORDER.split(", ")
    assert sorted(order) == sorted(PASSES)
    check_order([PASSES[name] for name in order])  # every pass, in that order: allowed


def _metadata(gm: torch.fx.GraphModule) -> dict[str, list[tuple]]:
    """Shape, stride, dtype and device of every tensor of every node's fake value."""
    from zerocc.ir.fake_values import _tensors

    return {
        n.name: [(tuple(t.shape), t.stride(), t.dtype, t.device) for t in _tensors(n.meta["val"])]
        for n in gm.graph.nodes
        if n.op == "call_function"
    }


@pytest.mark.parametrize(
    "plan",
    [
        "zero0.yaml",
        "zero1.yaml",
        "zero2.yaml",
        "zero3.yaml",
        "zero3-bf16.yaml",
        "zero3-offload.yaml",
        {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "overlap": {"bucket_mb": 1}},
        {"zero": {"stage": 2}, "precision": {"param": "fp16"}, "grad_accumulation": 2},
    ],
    ids=str,
)
def test_values_propagated_after_each_pass_are_those_of_a_full_propagation(plan):
    """Each pass re-runs on fake tensors only the nodes it changed and what depends on them
    (zerocc.ir.fake_values): the result must be what running every node again gives, the
    values (shapes, strides, dtypes, devices) and the memory the liveness analysis predicts
    from their storages."""
    from pathlib import Path

    from zerocc.cost.memory import predict_memory
    from zerocc.inspect.estimate import inspect_plan
    from zerocc.ir.fake_values import propagate_all_fake_values

    examples = Path(__file__).parents[3] / "examples" / "gpt"
    if isinstance(plan, str):
        plan = zerocc.load_plan(examples / plan)
    else:
        plan = zerocc.load_plan({"workload": "workload:workload", **plan})
    for compiled in inspect_plan(plan, 2).programs.values():
        gm = compiled.gm
        incremental, peak = _metadata(gm), predict_memory(gm, {}).peak()
        propagate_all_fake_values(gm)
        assert _metadata(gm) == incremental
        assert predict_memory(gm, {}).peak() == peak


def test_a_propagated_program_has_nothing_left_to_run():
    """Once every pass has propagated, nothing is stale: an op that returns its operand itself
    (``wait``, as its schema's alias says) holds that operand's value as its own, not a copy
    of another node's to run again (each wait ran again at every pass: 2888 runs on the 70B
    tp example)."""
    from pathlib import Path

    from zerocc.inspect.estimate import inspect_plan
    from zerocc.ir.fake_values import propagate_fake_values

    plan = zerocc.load_plan(Path(__file__).parents[3] / "examples" / "gpt" / "zero3.yaml")
    (compiled,) = inspect_plan(plan, 2).programs.values()
    waits = [n for n in compiled.gm.graph.nodes if op_name(n) == "wait"]
    assert waits and all(w.meta["val"] is w.args[0].meta["val"] for w in waits)
    assert propagate_fake_values(compiled.gm) == 0


# -- one source of pass order -------------------------------------------------------------


def test_an_unknown_capability_is_refused_when_the_pass_registers():
    from zerocc.compiler.passes.spec import PASSES, register_pass

    with pytest.raises(ValueError, match="unknown capability 'unit'; known: joint_graph, units"):
        register_pass("typo", provides=("unit",))(lambda gm, ctx: gm)
    assert "typo" not in PASSES


def test_a_pass_that_does_not_provide_what_it_promises_fails_under_verification():
    """A pass registered as providing units that tags no parameter with its unit: ZEROCC_VERIFY
    (on in the tests) says so after it runs, naming the pass, the capability and the untagged
    parameters (the compile session forms the units; the pass must tag them)."""
    from zerocc.compiler.passes.spec import PASSES, register_pass
    from zerocc.inspect.estimate import inspect_plan

    @register_pass("lazy_partition", provides=("units",))
    def lazy_partition(gm, ctx):
        """Claims to partition; does nothing."""
        return gm

    try:
        plan = zerocc.load_plan(
            {"workload": "workload:workload", "passes": ["lazy_partition", "shard", "optimizer"]}
        )
        with pytest.raises(
            InvariantError,
            match="'lazy_partition' did not provide.*units: parameters without a unit: "
            "p_transformer_wte_weight",
        ):
            inspect_plan(plan, 2)
    finally:
        del PASSES["lazy_partition"]
