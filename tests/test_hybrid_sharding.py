"""Hybrid sharding (``zero.replicate``): the ranks' layout, the plan's checks, and the program
and reports of a simulated 4-rank world (``FakeComm``) as 2 replicas of 2-rank shard groups.
Training parity on real gloo ranks: tests/parity/test_hsdp_parity.py; checkpoints between
hybrid and plain layouts: tests/parity/test_checkpoint_reshard_parity.py."""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt

import zerocc
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.errors import PlanError
from zerocc.ir.nodes import GRAD_SHARD, info, op_name


def test_shard_groups_are_consecutive_ranks_and_replicas_stride_across_them():
    mesh = Mesh.of(8, 2)
    assert mesh.shard_size == 4
    assert mesh.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.shard_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [mesh.replica(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "2 replicas × 4 shards" in mesh.describe()
    assert "dp groups [0-3], [4-7];" in mesh.describe()
    big = Mesh.of(1024, 128).describe()  # a line, not a thousand ranks
    assert "[0-7], [8-15], … (128 groups)" in big and "[0, 8, …, 1016]" in big and len(big) < 250


@pytest.mark.parametrize(
    ("world", "replicate", "says"),
    [(6, 4, "does not divide the world size 6"), (4, 4, "shard groups of one rank")],
)
def test_a_layout_the_ranks_cannot_take_is_a_plan_error(world, replicate, says):
    with pytest.raises(PlanError, match=says):
        Mesh.of(world, replicate)
    plan = {"zero": {"stage": 3, "replicate": replicate}, "backend": {"device": "cpu"}}
    with pytest.raises(PlanError, match=says):  # at compile, where the world size is known
        zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(world))


def test_replicas_need_a_sharded_stage():
    with pytest.raises(PlanError, match="stage 0 shards nothing"):
        zerocc.compile(tiny_gpt(), {"zero": {"stage": 0, "replicate": 2}})


def _step(stage: int = 3, **sections) -> zerocc.TrainStep:
    torch.manual_seed(0)
    plan = {
        "zero": {"stage": stage, "replicate": 2},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": 1.0},
        "backend": {"device": "cpu"},
        **sections,
    }
    step = zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(4))
    step(*_gpt_batch(0, 0))
    return step


def _collectives(step: zerocc.TrainStep) -> list[tuple[str, str, str | None]]:
    """(op, group, unit) of every collective start, in program order."""
    return [
        (op_name(n.target).removeprefix("zerocc."), n.args[-1], info(n).unit)
        for n in step.program.graph.nodes
        if op_name(n.target).endswith("_start")
    ]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_gradient_shard_is_all_reduced_across_replicas_before_its_update(stage):
    step = _step(stage)
    collectives = _collectives(step)
    replicated = [(op, unit) for op, group, unit in collectives if group == "replicate"]
    units = [u.name for u in step.units]
    assert sorted(replicated) == sorted(("all_reduce_start", u) for u in units)
    assert all(group in ("dp", "replicate") for _, group, _ in collectives)
    # what the update reads is the all-reduce's result, and it holds the unit's shard
    grads = [n for n in step.program.graph.nodes if info(n).role == GRAD_SHARD]
    assert {op_name(n.args[0].target) for n in grads} == {"zerocc.all_reduce_start"}
    shard_numel = {u.name: u.shard_numel for u in step.units}
    assert all(n.meta["val"].numel() == shard_numel[info(n).unit] for n in grads)


def test_units_are_sharded_over_the_shard_group_only():
    hybrid = _step()
    plain = zerocc.compile(
        tiny_gpt(),
        {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "backend": {"device": "cpu"}},
        comm=zerocc.FakeComm(2),
    )
    assert [u.shard_numel for u in hybrid.units] == [u.shard_numel for u in plain.units]
    assert hybrid.model_state_bytes() == plain.model_state_bytes()


def test_bucketing_leaves_the_all_reduces_across_replicas_alone():
    step = _step(overlap={"bucket_mb": 64})
    replicated = [c for c in _collectives(step) if c[1] == "replicate"]
    assert len(replicated) == len(step.units)


def test_explain_draws_the_mesh_and_counts_bytes_per_group():
    step = _step()
    text = step.explain()
    assert "mesh: 4 ranks = 2 replicas × 2 shards" in text
    moved = dict(step.comm.stats.bytes)
    shard_bytes = sum(u.shard_numel for u in step.units) * 4
    assert moved["all_reduce (replicate)"] == 2 * shard_bytes
    assert "all_reduce (replicate)" in text


def test_a_comm_not_split_into_a_mesh_has_no_replicate_group():
    comm = zerocc.FakeComm(4)
    assert comm.on("dp") is comm
    with pytest.raises(RuntimeError, match="no 'replicate' group"):
        comm.on("replicate")
