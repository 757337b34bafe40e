"""Expert parallelism (``parallel.ep``): the ranks' layout, the plan's checks, and the program
of a simulated world (``FakeComm``): each experts module a region exchanging its tokens, its
parameters each rank's experts, a unit of their own sharded over ``edp``. Training parity on
real gloo ranks: tests/parity/test_expert_parallel_parity.py."""

from __future__ import annotations

import pytest
import torch
from models import MoECausalLM, _token_batch, tiny_gpt

import zerocc
from zerocc.compiler.opaque import calls_in
from zerocc.compiler.parallel.experts import exchange_lines, exchanges_of, experts_flops
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.cost.model import CostModel, node_work
from zerocc.cost.rates import rates_for
from zerocc.errors import PlanError
from zerocc.inspect.estimate import estimate, inspect_plan
from zerocc.ir.nodes import op_name

pytest.importorskip(
    "transformers", reason='mixture-of-experts models need transformers: pip install "zerocc[hf]"'
)


def _plan(ep: int = 2, **extra) -> dict:
    return {
        "zero": {"stage": 3},
        "parallel": {"ep": ep},
        "units": {"classes": ["MixtralDecoderLayer"]},
        "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": 1.0},
        "backend": {"device": "cpu"},
        **extra,
    }


def _workload(experts: str = "grouped_mm") -> zerocc.Workload:
    torch.manual_seed(0)

    def batches(rank: int, world: int):
        while True:
            yield _token_batch(0, rank)

    return zerocc.Workload(MoECausalLM("mixtral", experts), batches=batches)


def test_ep_groups_are_neighbouring_data_ranks_and_edp_the_ranks_holding_the_same_experts():
    mesh = Mesh.of(8, ep=4)
    assert mesh.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.ep_rank(r) for r in range(8)] == [0, 1, 2, 3] * 2
    assert [mesh.group_rank("edp", r) for r in range(8)] == [0] * 4 + [1] * 4
    assert mesh.expert_shard_size == 2
    with_tp = Mesh.of(8, tp=2, ep=2)  # ep within each tp slice's ranks
    assert with_tp.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert with_tp.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "experts split over the ep groups [0-3], [4-7]" in mesh.describe()


def test_an_ep_that_does_not_divide_the_data_ranks_is_a_plan_error():
    with pytest.raises(PlanError, match="parallel.ep: 3 does not divide the 4 data-parallel"):
        zerocc.compile(MoECausalLM("mixtral", "grouped_mm"), _plan(3), comm=zerocc.FakeComm(4))


@pytest.mark.parametrize(
    ("model", "plan", "says"),
    [
        # 4 experts over 8 ranks
        (lambda: MoECausalLM("mixtral", "grouped_mm"), _plan(8),
         r"does not divide lm.model.layers.0.mlp.experts's 4 experts; allowed: 1, 2, 4"),
        (tiny_gpt, _plan(2, units={}), "this model has no experts module"),
        (lambda: MoECausalLM("mixtral", "grouped_mm"),
         _plan(2, parallel={"ep": 2, "experts": ["MoeExperts"]}),
         "no module of class 'MoeExperts' in the model"),
    ],
)  # fmt: skip
def test_a_model_expert_parallelism_cannot_split_is_a_plan_error_naming_it(model, plan, says):
    with pytest.raises(PlanError, match=says):
        zerocc.compile(model(), plan, comm=zerocc.FakeComm(8))


def test_the_program_holds_each_rank_s_experts_and_their_units_over_edp():
    inspection = inspect_plan(_plan(2), 4, _workload())
    experts = [u for u in inspection.units if u.name.endswith(".mlp.experts")]
    assert len(experts) == 2  # one unit per layer's experts, apart from the layer's
    assert all(u.group == "edp" and u.world_size == 2 for u in experts)
    # 2 of the 4 experts per rank: gate/up and down projections
    assert all(p.param.shape[0] == 2 for u in experts for p in u.params)
    dense = [u for u in inspection.units if u.name.endswith("DecoderLayer") or "layers." in u.name]
    assert all(u.group == "dp" and u.world_size == 4 for u in dense if u not in experts)
    gm = inspection.stepping.gm
    assert len(calls_in(gm)) == 2  # each layer's experts call, a region
    gathers = [n for n in gm.graph.nodes if op_name(n.target) == "zerocc.all_gather_start"]
    assert {n.args[-1] for n in gathers} == {"dp", "edp"}
    assert "all-to-all (ep 2)" in exchange_lines([gm])[0]
    assert any("all-to-all (ep 2)" in note for note in estimate(inspection).notes)


def test_the_predicted_step_waits_for_the_exchanges():
    """Each experts call's region costs its all-to-alls (2 in forward, 4 in backward: the
    recompute's and the gradients'), uniform routing taken, over the ep link: the estimate's
    step is longer by that much, and longer again on a slower ep link."""
    inspection = inspect_plan(_plan(2), 4, _workload())
    gm = inspection.stepping.gm
    found = [x for n in gm.graph.nodes if (x := exchanges_of(n)) is not None]
    assert sorted(x.count for x in found) == [2, 2, 4, 4]  # 2 layers' forward and backward
    rates = rates_for(inspection.plan, "cpu")
    cost = CostModel(rates, 4, Mesh.of_plan(inspection.plan, 4))
    one = cost.collective_time("all_to_all", found[0].nbytes, 2, "ep")
    region = next(n for n in gm.graph.nodes if exchanges_of(n) is not None)
    work = node_work(region)
    plain = cost.compute_time(work.flops, work.bytes, work.dtype)
    assert cost(region) == pytest.approx(plain + exchanges_of(region).count * one)
    slow = rates.replace("test", group_links={"ep": rates.link_bytes_per_s / 100})
    assert estimate(inspection, slow).timing.step_s > estimate(inspection, rates).timing.step_s
    # ... and the bytes per step count them (2 layers × 6 exchanges of a call's rows)
    assert estimate(inspection).comm["all_to_all (ep)"] == sum(x.count * x.nbytes for x in found)


@pytest.mark.parametrize(("ep", "experts"), [(1, "eager"), (2, "grouped_mm")])
def test_an_experts_region_counts_its_matmuls(ep, experts):
    """Opaque to the FLOP counter, an experts module's region (its eager experts kept opaque
    for their routing, or split by ep) counts every stacked expert weight [E, a, b] once per
    routed row (tokens × top-k, 2·a·b each) in forward, 3 times that in backward."""
    inspection = inspect_plan(_plan(ep), 4, _workload(experts))
    regions = [n for n in inspection.stepping.gm.graph.nodes if experts_flops(n) is not None]
    assert len(regions) == 4  # 2 layers' forward and backward
    experts = _workload().model.lm.model.layers[0].mlp.experts
    per_row = sum(2 * p.shape[1] * p.shape[2] for p in experts.parameters() if p.dim() == 3)
    rows = 2 * 16 * 2  # the batch's 2 × 16 tokens, each to its top 2
    flops = sorted(node_work(n).flops for n in regions)
    assert flops == [rows * per_row] * 2 + [3 * rows * per_row] * 2
    assert all(node_work(n).dtype == "fp32" for n in regions)


def test_the_same_model_without_ep_has_no_exchange():
    inspection = inspect_plan(_plan(1), 4, _workload())
    assert exchange_lines([inspection.stepping.gm]) == []
    assert all(u.group == "dp" for u in inspection.units)
