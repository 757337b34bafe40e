"""`zerocc estimate` of a pipeline plan: every pipeline rank's programs compiled for the world
size, its memory walked over its schedule, the step simulated (issue 47). The numbers here are
the cost model's, deterministic; that the memory walked is what a rank holds is
tests/cost/test_pipeline_memory.py's, and that the estimate's rank 0 is the trained rank 0's
is tests/cli/test_cli_pipeline.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path

from zerocc.cli.main import main
from zerocc.compiler.plan import load_plan
from zerocc.inspect.pipeline_estimate import estimate_pipeline
from zerocc.ir.nodes import info

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"


def test_a_pipelines_ranks_hold_what_1f1b_keeps_in_flight_and_gpipe_holds_more():
    e = estimate_pipeline(load_plan(EXAMPLES / "zero3-pp.yaml"), world_size=4)
    assert [r.stages for r in e.ranks] == [[0], [1]]
    # 1F1B: rank r keeps pp - r micro-batches for backward at its peak
    assert [r.memory.in_flight for r in e.ranks] == [2, 1]
    for r in e.ranks:
        assert r.memory.peak > r.memory.model_states + r.memory.kept > r.model_states["total"]
        assert r.seconds[r.stages[0], "B"] > r.seconds[r.stages[0], "F"] > 0
    # 2 ranks, 4 micro-batches: (pp - 1) / (M + pp - 1) = 20% at even stages, a little more
    # where the predicted stages differ
    assert 0.2 <= e.timeline.bubble < 0.3
    assert e.step_s > e.timeline.makespan
    assert isinstance(e.bubbles["zero-bubble"], str)  # 2 stages per rank: not these stages
    assert e.peaks["gpipe"] > e.peaks["1f1b"] == max(r.memory.peak for r in e.ranks)
    json.dumps(e.as_dict())


def test_what_stages_send_each_other_is_timed_on_the_pp_link():
    """The example's stage 0 sends each micro-batch's hidden states ([2, 64, 128] fp32) to
    stage 1, which sends their gradient back; on a link 1600 times slower
    (`cost.group_link_gbps: {pp: 0.01}`) each send takes ~52 ms, and the schedule has at
    least one forward and one backward send on its critical path."""
    plan = load_plan(EXAMPLES / "zero3-pp.yaml")
    activation = 2 * 64 * 128 * 4
    fast = estimate_pipeline(plan, world_size=4)
    assert fast.ranks[0].sent[0, "F"] == {1: activation}
    assert fast.ranks[1].sent[1, "B"] == {0: activation}
    assert "sends per micro-batch: 64.0KiB forward (timed on the pp link)" in fast.format()
    cost = plan.cost.model_copy(update={"group_link_gbps": {"pp": 0.01}})
    slow = estimate_pipeline(plan.model_copy(update={"cost": cost}), world_size=4)
    latency, link = slow.rates.link("send", "pp")
    assert link == 0.01e9 / 8
    send_s = latency + activation / link
    assert slow.timeline.makespan - fast.timeline.makespan > 2 * 0.9 * send_s
    assert slow.timeline.bubble > fast.timeline.bubble


def test_a_70b_pipeline_with_tensor_parallel_stages_estimates_each_rank(monkeypatch):
    """The 70B example's layout (pp 4 × dp 16 × tp 8 on 512 ranks), 8 of its blocks: four
    stages of two, each rank's layers split over tp 8 and sharded over dp 16."""
    plan = load_plan(EXAMPLES / "70b-pp.yaml")
    plan.workload_args["n_layer"] = 8
    e = estimate_pipeline(plan, world_size=512)
    assert [r.stages for r in e.ranks] == [[0], [1], [2], [3]]
    assert [r.memory.in_flight for r in e.ranks] == [4, 3, 2, 1]
    blocks = [r.model_states["total"] for r in e.ranks[1:3]]  # two blocks each, no ends
    assert blocks[0] == blocks[1]
    assert e.ranks[0].model_states["total"] > blocks[0]  # and the embedding's slice


def test_zerocc_estimate_prints_a_pipeline_plan(capsys):
    assert main(["estimate", str(EXAMPLES / "zero3-pp.yaml"), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline of 2 stages on 2 pipeline ranks, schedule 1f1b" in out
    assert "rank 1 (stages [1]): model states" in out
    assert re.search(r"\n  1f1b +bubble +\d+\.\d%  peak \S+MiB\n", out)
    assert main(["estimate", str(EXAMPLES / "zero3-pp.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "1f1b"


def test_zero3_gathered_once_per_step_moves_up_to_2m_times_fewer_bytes():
    """The example's stages (ZeRO-3, 4 micro-batches): gathered per micro-batch, each forward
    and backward gathers the units it reads (up to 2 × 4 gathers of each); once per step, the
    update gathers the new parameters once. Reduce-scatters are per micro-batch either way."""
    plan = load_plan(EXAMPLES / "zero3-pp.yaml")
    assert plan.pipeline.gather == "step"
    once = estimate_pipeline(plan, world_size=4)
    per = estimate_pipeline(
        plan.model_copy(
            update={"pipeline": plan.pipeline.model_copy(update={"gather": "microbatch"})}
        ),
        world_size=4,
    )
    m = plan.pipeline.microbatches_of(plan.parallel.pp)
    for a, b in zip(once.ranks, per.ranks, strict=True):
        # (a unit its backward does not read, as an embedding, is not gathered there)
        assert m < b.collective_bytes["all_gather"] / a.collective_bytes["all_gather"] <= 2 * m
        assert b.collective_bytes["reduce_scatter"] == a.collective_bytes["reduce_scatter"]
        assert b.model_states["total"] < a.model_states["total"]  # parameters sharded at rest
    assert "gathered once per step" in once.format()
    assert "collectives per step: all_gather" in once.format()


def test_recompute_keeps_only_each_units_inputs_for_a_stages_backward():
    """recompute.units: all applied before the cut: a stage keeps its blocks' inputs, not their
    activations, from forward to backward, and its backward recomputes their forward."""
    plan = load_plan(EXAMPLES / "zero3-pp.yaml")
    kept = estimate_pipeline(plan, world_size=4)
    recomputed = plan.model_copy(
        update={"recompute": plan.recompute.model_copy(update={"units": "all"})}
    )
    again = estimate_pipeline(recomputed, world_size=4)
    for a, b in zip(kept.ranks, again.ranks, strict=True):
        assert b.memory.kept < a.memory.kept / 4
        assert b.seconds[b.stages[0], "B"] > a.seconds[a.stages[0], "B"]
    backward = again.inspection.staged.stages[0].backward.gm.graph.nodes
    notes = {info(n).note for n in backward if (info(n).note or "").startswith("recomputed")}
    assert notes == {
        "recomputed: forward of transformer.h.0",
        "recomputed: forward of transformer.h.1",
    }
