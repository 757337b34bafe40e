"""Expert parallelism (``parallel.ep``): the ranks' layout, the plan's checks, and the program
of a simulated world (``FakeComm``): each experts call's tokens exchanged by all-to-alls of
the program, its parameters each rank's experts, a unit of their own sharded over ``edp``.
Training parity on real gloo ranks: tests/parity/test_expert_parallel_parity.py."""

from __future__ import annotations

import pytest
import torch
from models import MoECausalLM, _token_batch, tiny_gpt

import zerocc
from zerocc.compiler.opaque import calls_in
from zerocc.compiler.parallel.experts import exchange_lines, experts_flops
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.cost.model import CostModel, node_work
from zerocc.cost.rates import rates_for
from zerocc.errors import PlanError
from zerocc.inspect.estimate import estimate, inspect_plan
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import info, op_name
from zerocc.ir.printing import format_program

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
    assert calls_in(gm) == []  # no opaque region: the exchanges are ops of the program
    gathers = [n for n in gm.graph.nodes if op_name(n.target) == "zerocc.all_gather_start"]
    assert {n.args[-1] for n in gathers} == {"dp", "edp"}
    assert "all-to-all (ep 2)" in exchange_lines([gm], 2)[0]
    assert any("all-to-all (ep 2)" in note for note in estimate(inspection).notes)


def _exchanges(gm) -> dict[str, list]:
    found: dict[str, list] = {}
    for n in gm.graph.nodes:
        name = op_name(n.target)
        if name.startswith("zerocc.all_to_all"):
            found.setdefault(name.removeprefix("zerocc."), []).append(n)
    return found


def test_the_exchanges_are_collectives_of_the_program_on_the_ep_group():
    """Per experts call: its counts (num_experts integers), its rows out and their results
    back in forward, the results' gradients out and the rows' gradients back in backward;
    each a start on the comm stream over ep with its wait, the rows' bytes a call's
    tokens × top-k rows."""
    inspection = inspect_plan(_plan(2), 4, _workload())
    gm = inspection.stepping.gm
    found = _exchanges(gm)
    assert {k: len(v) for k, v in found.items()} == {
        "all_to_all_start": 2,  # 2 layers' counts
        "all_to_all_experts_start": 4,  # 2 layers' rows (forward), results' gradients (backward)
        "all_to_all_tokens_start": 4,  # their results (forward), rows' gradients (backward)
    }
    rows_bytes = 2 * 16 * 2 * 32 * 4  # 2 × 16 tokens to their top 2, hidden 32, fp32
    for start in (n for nodes in found.values() for n in nodes):
        assert start.args[-1] == "ep" and info(start).stream == Stream.COMM
        (wait,) = start.users
        assert op_name(wait.target) == "zerocc.wait"
    assert {info(n).bytes for n in found["all_to_all_start"]} == {4 * 8}  # 4 experts, int64
    rows = found["all_to_all_experts_start"] + found["all_to_all_tokens_start"]
    assert {info(n).bytes for n in rows} == {rows_bytes}
    assert sum(op_name(n.target) == "zerocc.experts_forward" for n in gm.graph.nodes) == 2
    assert sum(op_name(n.target) == "zerocc.experts_backward" for n in gm.graph.nodes) == 2


def test_the_predicted_step_pays_for_the_exchanges():
    """Each exchange is costed as an all-to-all over the ep link, uniform routing taken: the
    estimate's step is longer on a slower ep link, and the bytes per step count them."""
    inspection = inspect_plan(_plan(2), 4, _workload())
    gm = inspection.stepping.gm
    rates = rates_for(inspection.plan, "cpu")
    cost = CostModel(rates, 4, Mesh.of_plan(inspection.plan, 4))
    starts = [n for nodes in _exchanges(gm).values() for n in nodes]
    for start in starts:
        assert cost(start) == pytest.approx(
            cost.collective_time("all_to_all", info(start).bytes, 2, "ep")
        )
    slow = rates.replace("test", group_links={"ep": rates.link_bytes_per_s / 100})
    assert estimate(inspection, slow).timing.step_s > estimate(inspection, rates).timing.step_s
    assert estimate(inspection).comm["all_to_all (ep)"] == sum(info(n).bytes for n in starts)


@pytest.mark.parametrize(("ep", "experts"), [(1, "eager"), (2, "grouped_mm")])
def test_an_experts_call_counts_its_matmuls(ep, experts):
    """Opaque to the FLOP counter, an experts call (its eager experts kept as a region for
    their routing, or run on the rows ep's exchange brought) counts every stacked expert
    weight [E, a, b] once per routed row (tokens × top-k, 2·a·b each) in forward, 3 times that
    in backward."""
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
    assert exchange_lines([inspection.stepping.gm], 1) == []
    assert _exchanges(inspection.stepping.gm) == {}
    assert all(u.group == "dp" for u in inspection.units)


def test_the_rows_the_runtime_keeps_count_in_the_predicted_memory(monkeypatch):
    """The rows a call receives are no value of the program: the memory prediction adds them,
    a call's rows each (uniform routing), from the exchange that receives them to the experts'
    backward; the experts' results and the gradients likewise, between their ops."""
    from zerocc.compiler.parallel.experts import payloads
    from zerocc.cost import memory

    gm = inspect_plan(_plan(2), 4, _workload()).stepping.gm
    rows_bytes = 2 * 16 * 2 * 32 * 4
    spans = payloads(gm)
    assert len(spans) == 8  # per call: its rows, results, results' and rows' gradients
    assert all(made is not None and taken is not None for made, taken, _ in spans)
    assert {nbytes for *_, nbytes in spans} == {rows_bytes}
    kept = memory.predict_memory(gm, {}).series["activations"]
    monkeypatch.setattr(memory, "payloads", lambda gm: [])
    without = memory.predict_memory(gm, {}).series["activations"]
    extra = [a - b for a, b in zip(kept, without, strict=True)]
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    first_backward = next(
        i for i, n in enumerate(nodes) if op_name(n.target) == "zerocc.experts_backward"
    )
    # both layers' rows, and the last layer's results' gradients arriving, its rows' leaving
    assert extra[first_backward] == 4 * rows_bytes
    assert min(extra) == 0 and extra[-1] == 0 and max(extra) == 4 * rows_bytes


def _qwen_plan(**extra) -> dict:
    return {**_plan(2, **extra), "units": {"classes": ["Qwen2MoeDecoderLayer"]}}


def _qwen() -> zerocc.Workload:
    torch.manual_seed(0)

    def batches(rank: int, world: int):
        while True:
            yield _token_batch(0, rank)

    return zerocc.Workload(MoECausalLM("qwen_moe", "grouped_mm"), batches=batches)


def _shared_expert_matmuls_in_flight(gm, start_op: str, phase: str) -> list[int]:
    """For each exchange of ``start_op`` in ``phase``: the shared expert's matmuls between its
    start and its wait."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    found = []
    for start in nodes:
        if op_name(start.target) != start_op or info(start).phase != phase:
            continue
        (wait,) = start.users
        between = nodes[position[start] + 1 : position[wait]]
        found.append(sum(
            "shared_expert" in (info(n).module or "") and op_name(n.target).startswith("aten.mm")
            for n in between
        ))  # fmt: skip
    return found


def test_the_rows_in_flight_overlap_the_shared_expert():
    """Qwen2-MoE computes its shared expert before its router. The overlap pass issues each
    call's rows out before the shared expert, which runs while they are in flight (its 3
    matmuls); without the pass it runs before. The printed program holds the exchanges."""
    gm = inspect_plan(_qwen_plan(), 4, _qwen()).stepping.gm
    found = _shared_expert_matmuls_in_flight(gm, "zerocc.all_to_all_experts_start", "forward")
    assert found == [3, 3]  # each layer's
    assert "zerocc.all_to_all_experts_start" in format_program(gm)
    plain = inspect_plan(_qwen_plan(overlap={"enabled": False}), 4, _qwen()).stepping.gm
    found = _shared_expert_matmuls_in_flight(plain, "zerocc.all_to_all_experts_start", "forward")
    assert found == [0, 0]


def test_the_rows_gradients_come_back_while_backward_goes_on():
    """In backward the rows' gradients come back (an all-to-all) while the ops that do not
    read them run: the wait and the ops reading what it brought move below them."""
    gm = inspect_plan(_qwen_plan(), 4, _qwen()).stepping.gm
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    returns = [
        n for n in nodes
        if op_name(n.target) == "zerocc.all_to_all_tokens_start" and info(n).phase == "backward"
    ]  # fmt: skip
    assert len(returns) == 2
    for start in returns:
        (wait,) = start.users
        between = nodes[position[start] + 1 : position[wait]]
        assert sum(op_name(n.target).startswith("aten.") for n in between) >= 5
        assert "waited on late" in info(wait).note
