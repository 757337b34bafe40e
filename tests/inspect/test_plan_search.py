"""`zerocc plan auto` (issue 52, first part): every candidate of the search space compiled and
predicted, the fastest that fits chosen and written as a plan, the fields the plan sets kept.
The figures are the cost model's (deterministic); that they match measured runs is the
estimate's tests' (tests/inspect/test_estimate.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from zerocc.cli.main import main
from zerocc.compiler.plan import load_plan
from zerocc.cost.rates import rates_for
from zerocc.errors import PlanError
from zerocc.inspect.pipeline_estimate import estimate_pipeline
from zerocc.inspect.plan_search import best_plan_yaml, search_plans, search_space

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"
OPEN = {  # the example's zero3.yaml without its stage: stage and recompute are searched
    "workload": "workload:workload",
    "workload_args": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64,
                      "batch_size": 8},
    "units": {"classes": ["Block"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def searched():
    plan = load_plan({**OPEN, "workload": f"{EXAMPLES / 'workload.py'}:workload"})
    return search_plans(plan, 2, 2**40, rates_for(plan, "cpu"), exhaustive=True)


def test_every_stage_and_recompute_choice_is_predicted_and_the_fastest_chosen(searched):
    fields = [c.fields for c in searched.grid]
    assert len(fields) == 12 and {f["zero.stage"] for f in fields} == {0, 1, 2, 3}
    # recomputing none, every other block (the first and third of 4) or all
    half = ["transformer.h.0", "transformer.h.2"]
    assert {str(f["recompute.units"]) for f in fields} == {"none", "all", str(half)}
    assert all(c.error is None and c.step_s > 0 and c.peak > 0 for c in searched.candidates)
    assert all(c.bound_by in ("compute", "communication") for c in searched.candidates)
    # stage 0 all-reduces its gradients, stage 3 gathers and reduce-scatters more on `dp`
    by_stage = {c.fields["zero.stage"]: c.moved for c in searched.candidates}
    assert 0 < by_stage[0]["dp"] < by_stage[3]["dp"]
    # the example counts its tokens: 2 ranks × 8 sequences of 64 per step
    assert searched.counts_tokens and {c.work for c in searched.candidates} == {2 * 8 * 64}
    assert f"{2 * 8 * 64 / searched.candidates[0].step_s:,.0f}" in searched.format()
    times = [c.step_s for c in searched.candidates]
    assert times == sorted(times)
    assert searched.best is searched.candidates[0]
    # recomputation trades time for memory: each stage's is slower and lighter, half of it
    # between
    for stage in range(4):
        none, some, full = (
            next(c for c in searched.candidates if c.fields == {"zero.stage": stage,
                                                                "recompute.units": r})
            for r in ("none", half, "all")
        )  # fmt: skip
        assert full.step_s > some.step_s > none.step_s
        assert full.peak < some.peak < none.peak
    assert "recompute.units: ['transformer.h.0', 'transformer.h.2']" in searched.format()


def test_the_pick_is_tried_with_units_of_two_blocks_buckets_and_deeper_prefetch(searched):
    """Around the grid's fastest (stage 1 here): its blocks two to a unit, and its
    collectives in buckets of two blocks (the example's 0.79 MB blocks: 2 MB; on CPU rates
    their copies cost more than they save). Two blocks to a unit is faster here, so the
    search climbs on from it: its units, now two blocks each, in buckets of two (4 MB), which
    is slower, and the climb ends. The stage-3 pick of a plan that fixes its units and
    buckets is tried with a second unit prefetched instead."""
    first = searched.grid[0]
    refined = {str(c.fields): c for c in searched.candidates if c not in searched.grid}
    two_blocks = {**first.fields, "units.blocks_per_unit": 2}
    bucketed = str({**first.fields, "overlap.bucket_mb": 2.0})
    climbed = str({**two_blocks, "overlap.bucket_mb": 4.0})
    assert set(refined) == {str(two_blocks), bucketed, climbed}
    assert refined[bucketed].step_s > first.step_s
    assert refined[str(two_blocks)].step_s < first.step_s
    assert refined[climbed].step_s > refined[str(two_blocks)].step_s
    assert searched.best is min(searched.candidates, key=lambda c: (c.step_s, c.peak))
    plan = load_plan({**OPEN, "workload": f"{EXAMPLES / 'workload.py'}:workload",
                      "zero": {"stage": 3}, "overlap": {"bucket_mb": 0},
                      "units": {"classes": ["Block"], "blocks_per_unit": 1}})  # fmt: skip
    fixed = search_plans(plan, 2, 2**40, rates_for(plan, "cpu"), exhaustive=True)
    pick = min(fixed.grid, key=lambda c: (c.step_s, c.peak))
    deeper = [c.fields for c in fixed.candidates if c not in fixed.grid]
    assert deeper == [{**pick.fields, "overlap.prefetch": 2}]


def test_a_rank_with_less_memory_gets_the_fastest_plan_under_it(searched):
    fastest = searched.candidates[0]
    tight = dataclasses.replace(searched, memory=fastest.peak - 1)
    best = tight.best
    assert best is not fastest and best.peak < fastest.peak
    assert all(c.peak > tight.memory for c in tight.candidates if c.step_s < best.step_s)
    assert "faster candidate(s) need" in tight.format()
    written = yaml.safe_load(best_plan_yaml(tight))
    assert written["zero"]["stage"] == best.fields["zero.stage"]
    assert written["recompute"]["units"] == best.fields["recompute.units"]
    assert written["units"] == {"classes": ["Block"]}  # (the plan's own fields kept)
    none = dataclasses.replace(searched, memory=1)
    assert none.best is None
    assert "no candidate fits (the closest" in none.format()


def test_zerocc_plan_auto_writes_a_plan_that_loads_and_keeps_what_the_plan_fixes(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**OPEN, "workload": f"{EXAMPLES / 'workload.py'}:workload",
                                    "zero": {"stage": 2}}))  # fmt: skip
    assert main(["plan", "auto", str(plan), "--world-size", "2", "--device", "cpu"]) == 0
    chosen = load_plan(tmp_path / "plan.auto.yaml")
    assert chosen.zero.stage == 2  # fixed by the plan: not searched
    assert chosen.recompute.units in ("none", "all")
    tiny = ["plan", "auto", str(plan), "--world-size", "2", "--device", "cpu", "--memory", "1e-6",
            "--gpus-per-node", "2", "--overwrite"]  # fmt: skip  (issue 52's --ranks-per-node)
    assert main(tiny) == 2


def test_zerocc_plan_auto_refuses_an_existing_output_before_it_searches(tmp_path, capsys):
    """A plan auto run again does not replace the plan the last one wrote (perhaps edited
    since) without --overwrite; it says so before compiling any candidate."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**OPEN, "workload": f"{EXAMPLES / 'workload.py'}:workload"}))
    written = tmp_path / "plan.auto.yaml"
    written.write_text("# edited by hand\n")
    assert main(["plan", "auto", str(plan), "--world-size", "2", "--device", "cpu"]) == 2
    said = capsys.readouterr()
    assert f"{written}: exists; --overwrite replaces it" in said.err
    assert "candidate" not in said.out  # (no search ran)
    assert written.read_text() == "# edited by hand\n"


@pytest.mark.parametrize(
    ("base", "fields"),
    [
        (None, {"zero.stage": 0}),
        (None, {"zero.stage": 3, "recompute.units": "all"}),
        (None, {"zero.stage": 2, "grad_accumulation": 2}),
        (None, {"zero.stage": 3, "offload.optimizer": "cpu", "backend.device": "cuda"}),
        ("zero3-tp.yaml", {"zero.stage": 1, "recompute.units": "all"}),
    ],
    ids=str,
)
def test_a_copied_capture_compiles_what_a_fresh_one_does(base, fields):
    """The search captures once and runs each candidate's passes on a copy: every program is
    the one a capture of its own gives, node for node, with its records, values and memory."""
    from zerocc.compiler.driver.plan_changes import derive_plan
    from zerocc.compiler.driver.program import CapturedSteps
    from zerocc.compiler.driver.session import CompileSession
    from zerocc.compiler.workload import load_workload
    from zerocc.cost.memory import predict_memory
    from zerocc.inspect.estimate import first_batch, inspect_plan
    from zerocc.ir.nodes import info

    if base is None:
        base = load_plan({**OPEN, "workload": f"{EXAMPLES / 'workload.py'}:workload"})
    else:
        base = load_plan(EXAMPLES / base)
    world = 2 * base.parallel.tp
    plan = derive_plan(base, fields)
    workload = load_workload(plan)
    captured = CapturedSteps()
    inspect_plan(base, world, workload, captured=captured)  # (another candidate's, first)
    reused = inspect_plan(plan, world, workload, captured=captured)
    session = CompileSession.open(workload.model, plan, world, workload.loss_fn)
    batch = first_batch(workload, session.mesh.data_parallel)
    for boundary, program in reused.programs.items():
        gm = program.gm
        expected = session.program(batch, boundary=boundary, device=torch.device("cpu")).gm
        assert "copied from an earlier capture" in program.records[0].header
        assert str(gm.graph) == str(expected.graph)
        for a, b in zip(gm.graph.nodes, expected.graph.nodes, strict=True):
            assert info(a) == info(b), a.name
            value, other = a.meta.get("val"), b.meta.get("val")
            if isinstance(value, torch.Tensor):
                assert (value.shape, value.stride(), value.dtype) == (
                    other.shape, other.stride(), other.dtype
                ), a.name  # fmt: skip
        assert predict_memory(gm, {}).peak() == predict_memory(expected, {}).peak()


def test_pipelines_are_searched_and_timed_by_their_schedule(monkeypatch):
    """With ``pipelines``, the example GPT (4 blocks, 5 units) on 4 ranks with its stage and
    recomputation fixed: pipelines of 2 and 4 stages' ranks are tried beside none, each with
    1f1b and zero-bubble (ZBV needs two stages a rank: 8 stages of 5 units is a plan error,
    listed); each pipeline candidate's figures are `zerocc estimate`'s for its plan; a plan
    that fixes its pipeline is searched around it, with or without the flag. The search
    captures a micro-batch's step once per pipeline degree and micro-batch count, not once
    per candidate."""
    data = yaml.safe_load((EXAMPLES / "zero3.yaml").read_text())
    data["workload"] = f"{EXAMPLES / 'workload.py'}:workload"
    data["recompute"] = {"units": "none"}
    plan = load_plan(data)
    rates = rates_for(plan, "cpu")
    captures = _counted_pipeline_captures(monkeypatch)
    searched = search_plans(plan, 4, 2**40, rates, exhaustive=True, pipelines=True)
    pipelines = [c for c in searched.candidates if c.fields["parallel.pp"] > 1]
    shapes = {(c.fields["parallel.pp"], _microbatches(c.fields)) for c in pipelines}
    assert len(pipelines) > len(shapes) and len(captures) == len(shapes), captures
    by = {
        (c.fields["parallel.pp"], c.fields["pipeline.schedule"],
         c.fields["pipeline.microbatches"]): c
        for c in searched.grid
    }  # fmt: skip
    # each pipeline also with 2 and 4 times its default micro-batches, where the rank's batch
    # of 8 divides into them (ZBV's default is 4 on 2 ranks: 8; 16 does not divide)
    assert set(by) == {(1, "1f1b", None), (2, "1f1b", None), (2, "1f1b", 4), (2, "1f1b", 8),
                       (2, "zero-bubble", None), (2, "zero-bubble", 8), (4, "1f1b", None),
                       (4, "1f1b", 8), (4, "zero-bubble", None)}  # fmt: skip
    assert by[4, "zero-bubble", None].error is not None
    pipeline = by[2, "1f1b", None]
    derived = load_plan({**data, "parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b"}})
    expected = estimate_pipeline(derived, 4, rates=rates)
    assert pipeline.step_s == pytest.approx(expected.step_s)
    assert pipeline.peak == max(r.memory.peak for r in expected.ranks)
    assert pipeline.moved["pp"] > 0 and pipeline.work == by[1, "1f1b", None].work // 2
    assert "parallel.pp: 2" in searched.format()
    # more micro-batches: the same work, each figure `zerocc estimate`'s; 1F1B holds the
    # activations of fewer rows at a time
    more = load_plan({**data, "parallel": {"pp": 2}, "pipeline": {"microbatches": 8}})
    assert by[2, "1f1b", 8].step_s == pytest.approx(estimate_pipeline(more, 4, rates=rates).step_s)
    assert by[2, "1f1b", 8].work == pipeline.work
    assert by[2, "1f1b", 8].peak < by[2, "1f1b", 4].peak < pipeline.peak
    fixed = search_plans(derived, 4, 2**40, rates, exhaustive=True)  # (its stage fixed too)
    assert [c.fields["pipeline.microbatches"] for c in fixed.grid] == [None, 4, 8]
    assert fixed.grid[0].step_s == pytest.approx(expected.step_s)
    counted = search_plans(more, 4, 2**40, rates, exhaustive=True)  # (the count fixed too)
    assert len(counted.grid) == 1


def test_the_mesh_is_searched_within_and_across_machines():
    """A plan that names its tp layers but no degree gets tp 1 and 2 tried within a machine of 2
    ranks, and hybrid sharding (a replica per machine) across 2 machines. A tp group trains on
    one batch, so tp 2 trains half the tokens per step: candidates are ranked by time per
    token, not per step."""
    data = yaml.safe_load((EXAMPLES / "zero3-tp.yaml").read_text())
    del data["parallel"]["tp"], data["zero"]
    data["workload"] = f"{EXAMPLES / 'workload.py'}:workload"
    plan = load_plan(data)
    searched = search_plans(plan, 4, 2**40, rates_for(plan, "cpu"), ranks_per_node=2,
                            exhaustive=True)  # fmt: skip
    fields = [c.fields for c in searched.candidates]
    # (tp 2 with a replica per machine would shard over one rank: not a candidate)
    assert {(f["parallel.tp"], f["zero.replicate"]) for f in fields} == {(1, 1), (2, 1), (1, 2)}
    ok = [c for c in searched.candidates if c.error is None]
    assert {c.fields["parallel.tp"] for c in ok} == {1, 2}
    for c in ok:
        tp, replicate = c.fields["parallel.tp"], c.fields["zero.replicate"]
        assert c.work == 4 // tp * 8 * 64  # tokens: the data ranks' batches of 8 × 64
        assert ("tp" in c.moved) == (tp > 1), c.describe()
        if c.fields["zero.stage"] > 0:  # (stage 0 shards nothing to replicate)
            assert ("replicate" in c.moved) == (replicate > 1), c.describe()
    ranked = [c.seconds_per_work for c in ok]
    assert ranked == sorted(ranked)
    assert "parallel.tp: 2" in searched.format()


def test_compile_auto_searches_for_this_run_and_trains_the_choice(capsys):
    """``zerocc.compile(model, "auto", example=batch)``: the search for this run's ranks (one
    here), on the example micro-batch; the table is printed, the choice trained; fields a plan
    sets beside ``auto=True`` are kept."""
    from model import GPT, GPTConfig  # (examples/gpt, on the tests' path)

    import zerocc

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    step = zerocc.compile(gpt(), "auto", example=batch)
    table = capsys.readouterr().err
    assert "candidate plans on 1 ranks" in table and "best: zero.stage:" in table
    assert step.plan.recompute.units in ("none", "all")
    losses = [float(step(*batch)) for _ in range(3)]
    assert losses[-1] < losses[0]
    kept = zerocc.compile(gpt(), {"zero": {"stage": 1}}, auto=True, example=batch)
    assert kept.plan.zero.stage == 1
    assert "fixed by the plan, not searched: zero.stage: 1" in capsys.readouterr().err
    with pytest.raises(PlanError, match="pass example="):
        zerocc.compile(gpt(), "auto")


@pytest.fixture(scope="module")
def meshes():
    """The tp example without its stage and degree, on 2 machines of 2 ranks, on cuda's rates
    (offload searched too): every candidate compiled."""
    data = yaml.safe_load((EXAMPLES / "zero3-tp.yaml").read_text())
    del data["parallel"]["tp"], data["zero"]
    data["workload"] = f"{EXAMPLES / 'workload.py'}:workload"
    plan = load_plan(data)
    rates = rates_for(plan, "cuda")
    return plan, rates, search_plans(plan, 4, 2**40, rates, ranks_per_node=2, exhaustive=True)


@pytest.mark.parametrize(
    "tightness", [1.0, pytest.param(0.7, marks=pytest.mark.slow),
                  pytest.param(0.4, marks=pytest.mark.slow), 0.0]
)  # fmt: skip
def test_the_pruned_search_picks_what_compiling_every_candidate_picks(meshes, tightness):
    """Memory between the least and the most any candidate needs (1.0: all fit, 0.0: one): the
    search that prunes by the cost model's orders picks the exhaustive search's best of the
    search space and compiles fewer candidates; each pruned one names what rules it out. Its
    pick is then refined around under that memory (offload.ratio, say, where it is tight),
    never to a slower one."""
    plan, rates, every = meshes
    peaks = sorted(c.peak for c in every.candidates if c.predicted)
    memory = peaks[round(tightness * (len(peaks) - 1))]
    best = next(c for c in every.grid if c.fits(memory))  # (the exhaustive one's, at memory)
    pruned = search_plans(plan, 4, memory, rates, ranks_per_node=2)
    picked = next(c for c in pruned.grid if c.fits(memory))
    assert picked.fields == best.fields
    assert pruned.best.fits(memory) and pruned.best.seconds_per_work <= best.seconds_per_work
    assert len(pruned.grid) == len(every.grid)
    compiled = [c for c in pruned.grid if c.pruned is None]
    assert len(compiled) < len(every.grid)
    assert all(c.pruned.startswith("pruned: ") for c in pruned.candidates if c.pruned)
    assert f"{len(every.grid) - len(compiled)} pruned" in pruned.format()
    # a candidate pruned for its model states: they are a lower bound of its compiled peak
    peaks = {str(c.fields): c.peak for c in every.candidates}
    for c in pruned.candidates:
        if c.pruned and "model states alone" in c.pruned:
            assert memory < c.peak <= peaks[str(c.fields)], c.describe()


def test_where_nothing_fits_the_search_says_so_after_few_compiles(meshes):
    plan, rates, every = meshes
    least = min(c.peak for c in every.candidates if c.predicted)
    pruned = search_plans(plan, 4, least - 1, rates, ranks_per_node=2)
    assert pruned.best is None and "no candidate fits" in pruned.format()
    assert any("model states alone need" in (c.pruned or "") for c in pruned.candidates)
    # (each mesh: its first, then the most saving of that stage, then of the mesh: none fits)
    meshes_tried = {(c.fields["parallel.tp"], c.fields["zero.replicate"]) for c in every.candidates}
    assert sum(c.pruned is None for c in pruned.candidates) <= 3 * len(meshes_tried)


def test_a_secondary_partition_is_searched_where_a_machine_has_a_link_of_its_own():
    """Across 2 machines of 2 ranks, a slow network between them and NVLink-class links inside
    each (the plan's ``cost.group_link_gbps.secondary``), stage 3 with backward's gathers
    inside a machine is tried, and is faster than plain stage 3 at the cost of Ψ/2 held (on a
    fast network, this small model's step is its ops' overhead: the parts' copies cost more
    than the gathers they save); without that link it is not tried."""
    data = yaml.safe_load((EXAMPLES / "zero3.yaml").read_text())
    data["workload"] = f"{EXAMPLES / 'workload.py'}:workload"
    data["cost"] = {"link_gbps": 1, "group_link_gbps": {"secondary": 7200}}
    plan = load_plan(data)
    searched = search_plans(plan, 4, 2**40, rates_for(plan, "cuda"), ranks_per_node=2,
                            exhaustive=True)  # fmt: skip
    tried = {(c.fields["zero.replicate"], c.fields["zero.secondary_group"])
             for c in searched.candidates}  # fmt: skip
    assert tried == {(1, 1), (2, 1), (1, 2)}  # (2 replicas shard over 2: none to split)
    plain = {str(c.fields): c for c in searched.grid if c.fields["zero.secondary_group"] == 1}
    for c in searched.grid:
        if c.fields["zero.secondary_group"] == 2:
            twin = plain[str({**c.fields, "zero.secondary_group": 1})]
            assert c.step_s < twin.step_s and c.peak > twin.peak, c.describe()
    del data["cost"]["group_link_gbps"]
    assert "zero.secondary_group" not in search_space(load_plan(data), "cuda", 4, 2)[0]


def test_a_mixture_of_experts_gets_its_ep_degrees_searched():
    """Expert parallelism is tried for a model with experts modules (1, 2 and 4 on 4 ranks),
    its exchanges in the predicted time; a dense model gets no ep."""
    pytest.importorskip("transformers")
    plan = load_plan(EXAMPLES.parent / "huggingface" / "mixtral-tiny.yaml")
    searched = search_plans(plan, 4, 2**40, rates_for(plan, "cpu"), exhaustive=True)
    assert {c.fields["parallel.ep"] for c in searched.candidates} == {1, 2, 4}
    assert all(c.predicted for c in searched.candidates)
    assert "parallel.ep: 2" in searched.format()
    dense = load_plan({**OPEN, "workload": f"{EXAMPLES / 'workload.py'}:workload"})
    candidates = search_plans(dense, 2, 2**40, rates_for(dense, "cpu")).candidates
    assert all("parallel.ep" not in c.fields for c in candidates)


def _counted_pipeline_captures(monkeypatch) -> list[tuple[int, ...]]:
    """The micro-batch shapes of each pipeline capture from now on (a list that grows)."""
    import zerocc.inspect.pipeline as inspect_pipeline

    captures: list[tuple[int, ...]] = []
    capture = inspect_pipeline.capture_microbatch

    def counted(model, splits, plan, loss_fn, batch, device):
        captures.append(tuple(batch[0].shape))
        return capture(model, splits, plan, loss_fn, batch, device)

    monkeypatch.setattr(inspect_pipeline, "capture_microbatch", counted)
    return captures


def _microbatches(fields: dict) -> int:
    """A pipeline candidate's micro-batch count: its own, else its schedule's default."""
    from zerocc.compiler.plan.pipeline import PipelineConfig

    if fields["pipeline.microbatches"] is not None:
        return fields["pipeline.microbatches"]
    pipeline = PipelineConfig(schedule=fields["pipeline.schedule"])
    return pipeline.microbatches_of(fields["parallel.pp"])


def test_a_copied_pipeline_capture_estimates_what_a_fresh_one_does(monkeypatch):
    """A pipeline candidate whose micro-batch step another captured (same pipeline degree and
    micro-batch count; another stage and recomputation) is cut from a copy of that capture:
    its stages, programs' times, memory and bytes are those of a capture of its own."""
    from zerocc.compiler.driver.plan_changes import derive_plan
    from zerocc.compiler.driver.program import CapturedSteps
    from zerocc.compiler.workload import load_workload

    data = yaml.safe_load((EXAMPLES / "zero3-pp.yaml").read_text())
    data["workload"] = f"{EXAMPLES / 'workload.py'}:workload"
    other = derive_plan(load_plan(data), {"zero.stage": 1, "recompute.units": "none"})
    plan = derive_plan(load_plan(data), {"zero.stage": 3, "recompute.units": "all"})
    workload = load_workload(plan)
    rates = rates_for(plan, "cpu")
    captures = _counted_pipeline_captures(monkeypatch)
    captured = CapturedSteps()
    estimate_pipeline(other, 4, workload, rates, captured)
    reused = estimate_pipeline(plan, 4, workload, rates, captured)
    assert len(captures) == 1
    fresh = estimate_pipeline(plan, 4, workload, rates)
    assert len(captures) == 2
    assert reused.inspection.staged.format() == fresh.inspection.staged.format()
    assert reused.format() == fresh.format()
    for a, b in zip(reused.ranks, fresh.ranks, strict=True):
        assert (a.seconds, a.update_s, a.memory.peak, a.collective_bytes, a.sent) == (
            b.seconds, b.update_s, b.memory.peak, b.collective_bytes, b.sent
        )
