"""The plan's pipeline fields (parallel.pp and the pipeline section, issue 47): what they
default to, and the errors that name the field and what would work."""

from __future__ import annotations

import pytest

from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan import Plan, load_plan
from zerocc.errors import PlanError


def test_a_pipeline_defaults_to_1f1b_with_a_micro_batch_per_stage():
    plan = Plan.model_validate({"parallel": {"pp": 4}})
    assert plan.pipeline.schedule == "1f1b" and plan.pipeline.split == "auto"
    assert plan.pipeline.microbatches_of(4) == 4 and plan.pipeline.stages_per_rank_of() == 1
    zbv = Plan.model_validate({"parallel": {"pp": 2}, "pipeline": {"schedule": "zero-bubble"}})
    assert zbv.pipeline.stages_per_rank_of() == 2 and zbv.pipeline.microbatches_of(2) == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pipeline": {"schedule": "gpipe"}}, "pipeline: a schedule for a pipeline of one stage"),
        (
            {"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b", "stages_per_rank": 2}},
            "pipeline.stages_per_rank: 1f1b runs 1 stage",
        ),
        (
            {
                "parallel": {"pp": 2},
                "pipeline": {"schedule": "interleaved-1f1b", "stages_per_rank": 1},
            },
            "interleaved-1f1b runs 2 or more stage",
        ),  # fmt: skip
        ({"parallel": {"pp": 2}, "grad_accumulation": 4}, "set pipeline.microbatches"),
        (
            {"parallel": {"pp": 2}, "pipeline": {"split": ["transformer.h.2", "transformer.h.3"]}},
            "pipeline.split names 2 units, but 2 stages",
        ),
        ({"parallel": {"pp": 2}, "pipeline": {"split": ["a", "a", "b"]}}, "names a unit twice"),
        ({"parallel": {"pp": 3}, "zero": {"world_size": 8}}, "parallel.pp: 3 does not divide"),
        (
            {"parallel": {"pp": 2, "dp": 3}, "zero": {"world_size": 8}},
            "dp 3 × tp 1 × pp 2 is 6 ranks, but the world size is 8",
        ),
        ({"parallel": {"pp": 2}, "pipeline": {"schedule": "dualpipe"}}, "1f1b"),
        ({"parallel": {"pp": 2}, "pipeline": {"microbatches": 1}}, "microbatches"),
        (
            {"parallel": {"pp": 2}, "zero": {"stage": 2}, "pipeline": {"gather": "microbatch"}},
            "pipeline.gather: microbatch applies to zero.stage 3 only: stage 2 holds",
        ),
        (
            {"parallel": {"pp": 2}, "zero": {"stage": 3}, "units": {"keep_gathered": ["root"]}},
            "units.keep_gathered with pipeline.gather: step",
        ),
        (
            {"parallel": {"pp": 2}, "zero": {"stage": 3}, "offload": {"params": "cpu"}},
            "offload.params: cpu with pipeline.gather: step",
        ),
        (
            {"parallel": {"pp": 2}, "units": {"classes": ["Block"], "blocks_per_unit": 2}},
            "units.blocks_per_unit: 2 with parallel.pp: 2: a pipeline's stages are cut",
        ),
    ],
)
def test_a_pipeline_the_ranks_cannot_run_is_a_plan_error_naming_the_field(fields, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_plan(fields)


def test_the_mesh_puts_pipeline_ranks_outermost():
    """rank = pp_rank × (dp × tp) + data_rank × tp + tp_rank: a stage's data-parallel and
    tensor-parallel groups stay together (inside a node), the pipeline spans them."""
    mesh = Mesh.of(16, tp=2, pp=2)
    assert mesh.data_parallel == 4 and mesh.stage_ranks == 8
    assert mesh.groups("pp") == [[r, r + 8] for r in range(8)]
    assert mesh.groups("dp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.groups("dp")[2:] == [[8, 10, 12, 14], [9, 11, 13, 15]]
    assert [mesh.pp_rank(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert mesh.data_rank(9) == mesh.data_rank(1) == 0  # one pipeline: one batch
    assert mesh.named_groups() == ["dp", "tp", "pp", "tie"]
    assert "2 pipeline stages' ranks × 4 shards × 2 tensor-parallel" in mesh.describe()
    # Every rank is in exactly one group of each kind.
    for name in mesh.named_groups():
        assert sorted(r for g in mesh.groups(name) for r in g) == list(range(16))
    hybrid = Mesh.of(8, replicate=2, pp=2)
    assert hybrid.groups("replicate") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_zero3_stages_gather_once_per_step_unless_the_plan_asks_per_microbatch():
    """pipeline.gather: step (the default) compiles a ZeRO-3 pipeline's stage programs as
    ZeRO-2 holds parameters; microbatch keeps them ZeRO-3 programs; other stages are theirs."""
    from zerocc.compiler.driver.pipeline import stage_plan

    def stage_of(zero: int, **pipeline) -> int:
        plan = load_plan({"parallel": {"pp": 2}, "zero": {"stage": zero}, "pipeline": pipeline})
        return stage_plan(plan).zero.stage

    assert stage_of(3) == 2
    assert stage_of(3, gather="microbatch") == 3
    assert [stage_of(z) for z in (0, 1, 2)] == [0, 1, 2]


def test_the_least_world_a_layout_takes_is_what_zerocc_train_launches_by_default():
    """`zerocc train` without --nproc launches the fewest ranks the plan's layout takes."""

    def least(fields: dict) -> int:
        return load_plan(fields).least_world_size()

    assert least({}) == 2
    assert least({"zero": {"replicate": 2}}) == 4  # (shard groups of 2 at least)
    layers = {"tp_layers": {"*.mlp.c_fc": "colwise"}}
    assert least({"parallel": {"pp": 2, "tp": 2, **layers}}) == 4
    assert least({"parallel": {"dp": 3, "tp": 2, **layers}}) == 6
    assert least({"zero": {"world_size": 8}}) == 8
