"""The cost model: rates and where they come from, the work of a node, the time of a node, and
the fits `zerocc profile` makes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from zerocc.compiler.plan import load_plan
from zerocc.cost.fit import nnls
from zerocc.cost.model import COLLECTIVE, COMPUTE, CostModel, NodeWork, node_work
from zerocc.cost.rates import DeviceRates, rates_for
from zerocc.errors import PlanError
from zerocc.inspect.calibrate import fit_compute
from zerocc.inspect.link_rates import fit_link
from zerocc.ir.nodes import tag

aten = torch.ops.aten


def _graph(build) -> dict[str, fx.Node]:
    """Nodes by name of a graph that ``build(graph, x, w)`` fills, with fake values."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    build(graph, x, w)
    graph.output(None)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode() as mode:
        x_val, w_val = torch.empty(64, 32), torch.empty(32, 16)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(x_val, w_val)
    return {n.name: n for n in gm.graph.nodes}


@pytest.fixture(scope="module")
def nodes() -> dict[str, fx.Node]:
    def build(g: fx.Graph, x: fx.Node, w: fx.Node) -> None:
        def call(name: str, target, *args) -> fx.Node:
            return g.create_node("call_function", target, args, name=name)

        mm = call("mm", aten.mm.default, x, w)
        call("add", aten.add.Tensor, mm, mm)
        call("add_", aten.add_.Tensor, mm, mm)
        call("t", aten.t.default, w)
        batched = call("batched", aten.view.default, x, [4, 16, 32])
        one = call("one", aten.view.default, w, [1, 32, 16])
        call(
            "bmm", aten.bmm.default, batched, call("expand", aten.expand.default, one, [4, 32, 16])
        )
        start = call("all_gather_start", torch.ops.zerocc.all_gather_start.default, x, 4, "dp")
        tag(start, stream="comm", bytes=4 * 64 * 32 * 4)
        call("wait", torch.ops.zerocc.wait.default, start)
        quantized = torch.ops.zerocc.all_gather_quantized_start.default
        tag(call("gather_fp8", quantized, x, 4, 256, "fp8", "dp"), stream="comm", bytes=1000)
        quantized = torch.ops.zerocc.reduce_scatter_quantized_start.default
        tag(call("scatter_int4", quantized, x, 4, 256, "int4", "dp"), stream="comm", bytes=1000)

    return _graph(build)


def test_matmuls_count_flops_and_the_rest_bytes(nodes):
    mm = node_work(nodes["mm"])
    assert mm == NodeWork(COMPUTE, flops=2 * 64 * 32 * 16, bytes=4 * (64 * 32 + 32 * 16 + 64 * 16),
                          dtype="fp32")  # fmt: skip
    bmm = node_work(nodes["bmm"])
    assert bmm.flops == 2 * 4 * 16 * 32 * 16
    assert bmm.bytes == 4 * (64 * 32 + 32 * 16 + 4 * 16 * 16)  # the expanded weight read once
    out = 64 * 16 * 4
    assert node_work(nodes["add"]) == NodeWork(COMPUTE, bytes=3 * out)  # reads 2, writes 1
    assert node_work(nodes["add_"]).bytes == 3 * out  # writes its input in place
    assert node_work(nodes["t"]) == NodeWork(COMPUTE)  # a view: only the op's overhead
    assert node_work(nodes["expand"]).bytes == 0
    gather = node_work(nodes["all_gather_start"])
    assert (gather.kind, gather.bytes, gather.ranks, gather.collective) == (
        COLLECTIVE, 4 * 64 * 32 * 4, 4, "all_gather")  # fmt: skip
    assert node_work(nodes["wait"]).kind == "wait"
    assert nodes["mm"].meta["zerocc_work"] is mm  # computed once


def test_a_quantized_collective_takes_its_coding_passes_from_the_compute_stream(nodes):
    """Its quantize and dequantize passes read and write the whole flat in its dtype, twice
    in fp32 and once in the wire format: memory-bound compute-stream time beside the share of
    the transfer that cannot overlap (here all of it, ``comm_overlap`` 0)."""
    gathered, full = 4 * 64 * 32, 64 * 32  # the fp8 gather's result; the int4 reduction's input
    gather, scatter = node_work(nodes["gather_fp8"]), node_work(nodes["scatter_int4"])
    assert gather.coded == gathered * (4 + 8 + 1)
    assert scatter.coded == full * (4 + 8) + full // 2
    assert node_work(nodes["all_gather_start"]).coded == 0
    rates = DeviceRates("cpu", {"fp32": 1e9}, 1e8, 1e-5, 1e9, 1e-6, 0.0)
    model = CostModel(rates, 4)
    for name, work in (("gather_fp8", gather), ("scatter_int4", scatter)):
        transfer = 3 / 4 * 1000 / 1e9
        coding = 2e-5 + work.coded / 1e8  # two passes' overhead, their bytes at memory speed
        assert model.stolen(nodes[name]) == pytest.approx(transfer + coding)
    assert model.stolen(nodes["all_gather_start"]) == pytest.approx(3 / 4 * 4 * 64 * 32 * 4 / 1e9)


def test_time_is_overhead_plus_the_roofline():
    rates = DeviceRates("cpu", {"fp32": 1e9, "bf16": 4e9}, 1e8, 1e-5, 1e9, 1e-6, 1.0)
    model = CostModel(rates, 4)
    assert model.compute_time(2e6, 1e3, "fp32") == pytest.approx(1e-5 + 2e-3)  # compute-bound
    assert model.compute_time(2e6, 1e6, "bf16") == pytest.approx(1e-5 + 1e-2)  # memory-bound
    assert model.compute_time(0, 0) == pytest.approx(1e-5)


def test_collectives_follow_the_ring_model():
    rates = DeviceRates("cuda", {"bf16": 1e15}, 1e12, 0.0, 50e9, 5e-6, 1.0)
    model = CostModel(rates, 8)
    size = 1 << 30
    gather = model.collective_time("all_gather", size)
    assert gather == pytest.approx(7 * 5e-6 + 7 / 8 * size / 50e9)
    assert model.collective_time("reduce_scatter", size) == gather
    # An all-reduce counts twice its tensor's bytes: twice the gather of that tensor.
    assert model.collective_time("all_reduce", 2 * size) == pytest.approx(2 * gather)
    assert model.collective_time("all_gather", size, ranks=1) == 0.0
    assert CostModel(rates, 1).collective_time("all_reduce", size) == 0.0


def test_a_mesh_group_can_have_a_link_of_its_own():
    """cost.group_link_gbps: tp's all-reduces on NVLink, the dp group's on the network."""
    plan = load_plan({"cost": {"group_link_gbps": {"tp": 7200}, "link_gbps": 400}})
    model = CostModel(rates_for(plan, device="cuda"), 8)
    size = 1 << 30
    on_dp = model.collective_time("all_reduce", size, 8, "dp")
    assert on_dp == pytest.approx(14 * 5e-6 + 7 / 8 * size / 50e9, rel=1e-6)
    assert model.collective_time("all_reduce", size, 8, "tp") == pytest.approx(
        14 * 5e-6 + 7 / 8 * size / 900e9, rel=1e-6
    )
    assert "tp group link 7.2e+03 Gbit/s" in model.rates.describe()


def test_rates_come_from_the_plan_over_the_calibration_over_the_defaults(tmp_path):
    calibrated = DeviceRates.defaults("cpu").replace("x", overhead_s=3e-6, link_bytes_per_s=1e8,
                                                     collectives={"all_gather": {
                                                         "latency_s": 1e-3,
                                                         "link_bytes_per_s": 2e7}})  # fmt: skip
    calibrated.save(tmp_path / "cal.json", {"device": "test"})
    assert json.loads((tmp_path / "cal.json").read_text())["measured"] == {"device": "test"}
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("cost: {calibration: cal.json, link_gbps: 8}\n")
    rates = rates_for(load_plan(plan_file))  # the calibration is relative to the plan
    assert rates.overhead_s == 3e-6 and rates.sources["overhead_s"] == "calibration"
    assert rates.link_bytes_per_s == 1e9 and rates.sources["link_bytes_per_s"] == "plan"
    assert rates.collectives == {}  # a link the plan sets replaces the per-kind fits
    assert rates.memory_bytes_per_s == DeviceRates.defaults("cpu").memory_bytes_per_s
    alone = rates_for(load_plan({}), calibration=tmp_path / "cal.json")
    assert alone.link("all_gather") == (1e-3, 2e7) and alone.link("all_reduce")[1] == 1e8
    cuda = rates_for(load_plan({"cost": {"compute_tflops": 100, "latency_us": 0}}), "cuda")
    assert cuda.compute_flops == {"fp32": 1e14, "bf16": 1e14, "fp16": 1e14, "fp8": 1e14}
    assert cuda.latency_s == 0 and cuda.sources["memory_bytes_per_s"] == "default"


def test_default_rates_are_said_with_how_to_calibrate(tmp_path):
    defaults = rates_for(load_plan({}), "cpu")
    warning = defaults.uncalibrated()
    assert "compute, memory, per-op overhead" in warning and "zerocc profile" in warning
    some = rates_for(load_plan({"cost": {"compute_tflops": 1, "memory_gb_per_s": 10}}), "cpu")
    assert "per-op overhead" in some.uncalibrated() and "compute," not in some.uncalibrated()
    DeviceRates.defaults("cpu").save(tmp_path / "cal.json", {})
    assert rates_for(load_plan({}), calibration=tmp_path / "cal.json").uncalibrated() is None


def test_bad_rates_are_clear_errors(tmp_path):
    with pytest.raises(PlanError, match="no default rates for device 'tpu'"):
        DeviceRates.defaults("tpu")
    with pytest.raises(PlanError, match="not found"):
        DeviceRates.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"rates": {}}')
    with pytest.raises(PlanError, match="not a zerocc calibration"):
        DeviceRates.load(tmp_path / "bad.json")


def test_nnls_keeps_coefficients_non_negative():
    rows = [[1.0, x] for x in range(10)]
    assert nnls(rows, [2 + 3 * x for x in range(10)]) == pytest.approx([2.0, 3.0])
    assert nnls(rows, [5 - 0.1 * x for x in range(10)])[1] == 0.0  # a negative slope: none


def test_fits_recover_the_rates_that_made_the_samples():
    truth = DeviceRates("cpu", {"fp32": 5e10}, 4e9, 2e-5, 1e9, 1e-4, 1.0)
    model = CostModel(truth, 2)
    works = [NodeWork(COMPUTE, flops=f, bytes=b, dtype="fp32" if f else None)
             for f in (0, 1e6, 1e8, 4e8) for b in (0, 1e5, 1e7)]  # fmt: skip
    samples = [(w, model.compute_time(w.flops, w.bytes, w.dtype)) for w in works]
    fitted, stats = fit_compute(samples, DeviceRates.defaults("cpu"))
    assert fitted.overhead_s == pytest.approx(2e-5, rel=1e-6)
    assert fitted.compute_flops["fp32"] == pytest.approx(5e10, rel=1e-6)
    assert fitted.memory_bytes_per_s == pytest.approx(4e9, rel=1e-6)
    assert stats["fitted_ms"] == pytest.approx(stats["measured_ms"])
    links = [{"kind": k, "bytes": b, "ranks": 2, "seconds": model.collective_time(k, b, 2)}
             for k in ("all_gather", "all_reduce") for b in (1e5, 1e6, 1e7)]  # fmt: skip
    fitted, stats = fit_link(links, fitted)
    assert fitted.latency_s == pytest.approx(1e-4, rel=1e-6)
    assert fitted.link_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert stats["median_error_pct"] == pytest.approx(0, abs=1e-6)


def test_an_estimate_traced_on_the_cpu_times_its_ops_at_the_device_s_rates():
    """A program compiled for an estimate computes on the CPU on behalf of the device the rates
    are for: only what the offload pass put on the host (``pool: host``) is host work."""

    def build(g: fx.Graph, x: fx.Node, w: fx.Node) -> None:
        g.create_node("call_function", aten.mm.default, (x, w), name="mm")
        update = g.create_node("call_function", aten.mul.Tensor, (x, 2.0), name="update")
        tag(update, pool="host")

    nodes = _graph(build)
    model = CostModel(DeviceRates.defaults("cuda"), 1)
    assert not node_work(nodes["mm"]).host and node_work(nodes["update"]).host
    moved = node_work(nodes["update"]).bytes
    assert model(nodes["update"]) == pytest.approx(5e-6 + moved / 120e9)
    assert model(nodes["mm"]) < model(nodes["update"])  # at the device's 3 TB/s, not 120 GB/s
