"""The simulator: programs whose step and exposed time are known by construction, then a real
scheduled program."""

from __future__ import annotations

import pytest
import torch
from models import tiny_gpt
from parity import batch_of
from torch import fx

from zerocc.compiler.workload import Workload
from zerocc.cost.memory import model_state_bytes_of, predict_memory
from zerocc.cost.model import CostModel
from zerocc.cost.rates import DeviceRates
from zerocc.cost.simulate import simulate, simulate_step
from zerocc.cost.timeline import exposed_us
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import tag

aten, zerocc_ops = torch.ops.aten, torch.ops.zerocc


class Program:
    """A hand-built program: compute ops and collectives, each given its cost."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.x = self.graph.placeholder("x")
        self.last = self.x
        self.costs: dict[fx.Node, float] = {}

    def compute(self, seconds: float) -> fx.Node:
        self.last = self.graph.call_function(aten.neg.default, (self.x,))
        self.costs[self.last] = seconds
        return self.last

    def gather(self, seconds: float, nbytes: int = 1000) -> fx.Node:
        start = self.graph.call_function(zerocc_ops.all_gather_start.default, (self.x, 2, "dp"))
        self.costs[start] = seconds
        return tag(start, stream="comm", bytes=nbytes, unit="u")

    def copy(self, seconds: float, direction: str = "to_host", nbytes: int = 2**20) -> fx.Node:
        start = self.graph.call_function(
            zerocc_ops.copy_start.default, (self.x, torch.device("cpu"), direction)
        )
        self.costs[start] = seconds
        return tag(start, stream="copy", bytes=nbytes, unit="u")

    def wait(self, start: fx.Node) -> fx.Node:
        self.last = self.graph.call_function(zerocc_ops.wait.default, (start,))
        return tag(self.last, stream="comm", unit="u")

    def module(self) -> fx.GraphModule:
        self.graph.output(self.last)
        return fx.GraphModule(torch.nn.Module(), self.graph)


@pytest.mark.parametrize("comm", [2.0, 3.0, 5.0])
def test_a_gather_issued_one_op_ahead_hides_min_of_comm_and_compute(comm):
    p = Program()
    gather = p.gather(comm)
    p.compute(3.0)
    p.wait(gather)
    p.compute(1.0)
    sim = simulate(p.module(), p.costs)
    assert sim.exposed_s == pytest.approx(comm - min(comm, 3.0))
    assert sim.step_s == pytest.approx(3.0 + sim.exposed_s + 1.0)
    assert sim.compute_s == pytest.approx(4.0) and sim.comm_s == pytest.approx(comm)


def test_a_wait_right_after_its_start_exposes_all_of_it():
    p = Program()
    p.compute(1.0)
    p.wait(p.gather(2.5))
    p.compute(1.0)
    sim = simulate(p.module(), p.costs)
    assert sim.exposed_s == pytest.approx(2.5)
    assert sim.step_s == pytest.approx(4.5)
    (record,) = sim.collectives
    assert (record.issued_s, record.start_s, record.end_s, record.waited_s) == (1.0, 1.0, 3.5, 1.0)


def test_copies_run_on_their_own_stream_beside_collectives():
    """A copy and a collective issued together both run from their issue; each wait blocks
    only for its own transfer."""
    p = Program()
    gather, copy = p.gather(2.0), p.copy(3.0)
    p.compute(1.0)
    p.wait(gather)  # exposed 1
    p.wait(copy)  # exposed 1 more: the copy ran from 0 to 3, beside the gather
    sim = simulate(p.module(), p.costs)
    assert sim.exposed_s == pytest.approx(2.0)
    assert sim.step_s == pytest.approx(3.0)
    assert sim.comm_s == pytest.approx(2.0) and sim.copy_s == pytest.approx(3.0)
    assert len(sim.collectives) == 1  # copies are not collectives
    tracks = {e.track for e in sim.events}
    assert {"comm", "copy to host"} <= tracks


def test_copies_each_way_run_at_once_and_each_way_in_order():
    """Copies to the device and to the host run on a stream each, as the runtime's (PCIe
    moves both ways at once): a gradient's copy to the host does not queue behind a parameter's
    copy in, while two copies the same way run one after the other."""
    p = Program()
    inward, outward, second_out = p.copy(3.0, "to_device"), p.copy(2.0), p.copy(2.0)
    p.wait(outward)  # from 0 to 2, beside the copy in: exposed 2
    p.wait(inward)  # to 3: exposed 1
    p.wait(second_out)  # behind the first out, from 2 to 4: exposed 1
    sim = simulate(p.module(), p.costs)
    assert sim.exposed_s == pytest.approx(4.0) and sim.step_s == pytest.approx(4.0)
    assert sim.copy_s == pytest.approx(7.0)  # both ways' busy time
    starts = {(e.track, e.start_us / 1e6) for e in sim.events if e.track.startswith("copy")}
    assert starts == {("copy to device", 0.0), ("copy to host", 0.0), ("copy to host", 2.0)}


def test_a_small_copy_runs_as_issued_not_behind_the_bulk_copies():
    """The step's scalars a host update reads (``INLINE_COPY_BYTES`` at most) are copied on
    the compute stream, as the runtime does: not queued behind the gradients' copies."""
    p = Program()
    bulk = p.copy(5.0)
    p.compute(1.0)
    scalars = p.copy(0.001, nbytes=4)
    p.wait(scalars)  # exposed 0.001: the copy itself, from 1 (behind the bulk: from 5)
    p.compute(1.0)
    p.wait(bulk)  # exposed 5 - 2.001
    sim = simulate(p.module(), p.costs)
    assert sim.step_s == pytest.approx(5.0) and sim.exposed_s == pytest.approx(3.0)
    small = next(e for e in sim.events if e.track == "copy to host" and e.duration_us < 1e4)
    assert small.start_us == pytest.approx(1e6)


def test_the_hosts_work_is_on_its_own_track_and_holds_the_compute_stream():
    """An offloaded unit's update (``pool: host``) drawn on a "host" track, timed into
    ``host_s``; the compute stream waits for it (the runtime runs it on the issuing thread), so
    a copy issued before it hides behind it."""
    p = Program()
    copy = p.copy(1.5)
    update = p.compute(2.0)
    tag(update, pool="host")
    p.wait(copy)  # the copy ran beside the update: nothing exposed
    p.compute(1.0)
    sim = simulate(p.module(), p.costs)
    assert sim.host_s == pytest.approx(2.0) and sim.compute_s == pytest.approx(3.0)
    assert sim.exposed_s == 0.0 and sim.step_s == pytest.approx(3.0)
    (host,) = [e for e in sim.events if e.track == "host"]
    assert host.start_us == 0.0 and host.duration_us == pytest.approx(2e6)
    assert sim.as_dict()["host_ms"] == pytest.approx(2000.0)


def test_a_copy_within_the_host_holds_the_compute_stream_not_a_copy_stream():
    """A compute copy kept in host memory, cast from the master a host update wrote
    (``host_to_host``: under ``offload.defer_updates: delayed``), is a pass over host memory on the
    thread that issues the device's work, as the runtime runs it: on the "host" track, the
    compute stream held meanwhile, beside what the copy streams move."""
    p = Program()
    param, master = p.graph.placeholder("param"), p.graph.placeholder("master")
    param.meta["val"] = torch.empty(8, dtype=torch.bfloat16)
    master.meta["val"] = torch.empty(8)
    bulk = p.copy(3.0)  # a gradient's copy to the host, on its stream
    args = (param, master, "host_to_host")
    start = p.graph.call_function(zerocc_ops.copy_into_start.default, args)
    p.costs[start] = 2.0
    tag(start, stream="copy", bytes=16, pool="host")
    p.wait(start)  # done when issued: the copy ran inline
    p.compute(1.0)
    p.wait(bulk)  # done at 3, as compute is: nothing exposed
    sim = simulate(p.module(), p.costs)
    assert sim.step_s == pytest.approx(3.0) and sim.exposed_s == 0.0
    assert sim.host_s == pytest.approx(2.0) and sim.copy_s == pytest.approx(3.0)
    (host,) = [e for e in sim.events if e.track == "host"]
    assert host.start_us == 0.0 and host.duration_us == pytest.approx(2e6)


def test_two_collectives_queue_in_issue_order():
    p = Program()
    first, second = p.gather(4.0), p.gather(3.0)
    p.compute(1.0)
    p.wait(second)  # FIFO: the second starts when the first ends, at 4, and ends at 7
    p.wait(first)  # done at 4: no wait
    sim = simulate(p.module(), p.costs)
    a, b = sim.collectives
    assert (a.start_s, a.end_s, b.start_s, b.end_s) == (0.0, 4.0, 4.0, 7.0)
    assert (b.exposed_s, a.exposed_s) == (6.0, 0.0)
    assert sim.step_s == pytest.approx(7.0) and sim.exposed_s == pytest.approx(6.0)


def test_issuing_a_collective_costs_compute_time():
    p = Program()
    gather = p.gather(2.0)
    p.compute(1.0)
    p.wait(gather)
    sim = simulate(p.module(), p.costs, issue_s=0.5)
    # issued at 0, on the comm stream 0..2; compute 0.5 (issue) + 1.0, then waits 0.5
    assert sim.compute_s == pytest.approx(1.5) and sim.exposed_s == pytest.approx(0.5)
    assert sim.step_s == pytest.approx(2.0)


def test_a_transfer_that_shares_the_cores_takes_its_time_from_compute():
    p = Program()
    gather = p.gather(2.0)
    p.compute(3.0)
    p.wait(gather)
    sim = simulate(p.module(), p.costs, stolen={gather: 1.5})  # 75% of it cannot overlap
    assert sim.step_s == pytest.approx(4.5) and sim.compute_s == pytest.approx(3.0)
    assert sim.exposed_s == sim.stolen_s == pytest.approx(1.5)
    assert exposed_us(sim.events) == pytest.approx(1.5e6)


def test_events_draw_both_tracks_and_the_exposed_waits():
    p = Program()
    gather = p.gather(2.0)
    p.compute(0.5)
    p.wait(gather)
    sim = simulate(p.module(), p.costs, rank=3)
    assert {(e.track, e.rank) for e in sim.events} == {("compute", 3), ("comm", 3)}
    (comm,) = [e for e in sim.events if e.track == "comm"]
    assert (comm.start_us, comm.duration_us, comm.args["bytes"]) == (0.0, 2e6, 1000)
    assert exposed_us(sim.events) == pytest.approx(sim.exposed_s * 1e6) == 1.5e6
    (wait,) = [e for e in sim.events if e.args.get("exposed")]
    assert (wait.name, wait.start_us, wait.duration_us) == ("wait all_gather u", 0.5e6, 1.5e6)


def test_a_step_of_several_micro_batches_adds_them_up():
    acc, stepping = Program(), Program()
    acc.wait(acc.gather(1.0))
    acc.compute(2.0)
    stepping.compute(1.0)
    stepping.wait(stepping.gather(4.0))
    programs = {False: acc.module(), True: stepping.module()}
    costs = {**acc.costs, **stepping.costs}
    sim = simulate_step(programs, 3, costs)
    assert sim.step_s == pytest.approx(2 * 3.0 + 5.0)
    assert sim.exposed_s == pytest.approx(2 * 1.0 + 4.0)
    assert len(sim.collectives) == 3
    assert [c.start_s for c in sim.collectives] == [0.0, 3.0, 7.0]


@pytest.fixture(scope="module")
def zero3():
    """The scheduled ZeRO-3 program of a tiny GPT for 4 simulated ranks (overlap on)."""
    batch = batch_of({"model": "gpt"}, 0, 0)
    workload = Workload(tiny_gpt(), batches=lambda rank, world: iter([batch]))
    plan = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "optimizer": {"grad_clip": 1}}
    return inspect_plan(plan, 4, workload)


def test_a_real_program_waits_for_every_collective_and_predicts_its_peak(zero3):
    gm = zero3.stepping.gm
    states = model_state_bytes_of(zero3.stepping.layout)
    model = CostModel(DeviceRates.defaults("cpu"), 4)
    sim = simulate(gm, model, issue_s=model.issue_s, model_states=states)
    starts = [n for n in gm.graph.nodes if n.op == "call_function" and "_start" in n.name]
    assert len(sim.collectives) == len(starts) >= 10
    assert sim.step_s == pytest.approx(sim.compute_s + sim.exposed_s)  # ends on a wait or op
    assert 0 <= sim.exposed_s <= sim.comm_s
    for before, after in zip(sim.collectives, sim.collectives[1:], strict=False):
        assert after.start_s >= before.end_s  # one comm stream, FIFO
    assert sim.peak_bytes == predict_memory(gm, states).peak()[1]
