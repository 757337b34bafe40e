"""The backend interface (zerocc/backends/__init__.py) and the eager backend
(zerocc/backends/eager/): an executable owns what it has in flight, keyed by node; there are no
module-level runtime stacks; a second backend plugs in through the registry; profiling runs
through the backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocc
import zerocc.backends.eager.ops
import zerocc.engine.comm
import zerocc.engine.transfers
from zerocc.backends import BACKENDS, eager, register_backend, resolve_backend
from zerocc.backends.eager.executable import bind
from zerocc.backends.eager.ops import EagerOps
from zerocc.backends.kernels import kernel_set
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import FakeComm
from zerocc.engine.transfers import Transfers
from zerocc.ir.nodes import op_name

PLAN = {"zero": {"stage": 3}, "backend": {"device": "cpu"}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _context(world_size: int = 2) -> RuntimeContext:
    cpu = torch.device("cpu")
    return RuntimeContext(FakeComm(world_size), Transfers(device=cpu), kernel_set("torch"), cpu)


def _losses(plan: dict, steps: int = 3) -> list[float]:
    step = zerocc.compile(_model(), plan, loss_fn=_loss, comm=FakeComm(2))
    g = torch.Generator().manual_seed(1)
    return [float(step(torch.randn(4, 8, generator=g))) for _ in range(steps)]


def test_handles_in_flight_are_the_executables_own_keyed_by_node():
    first, second = EagerOps(_context()), EagerOps(_context())
    gathered = first.all_gather_start(torch.ones(3), 2, "dp", started="all_gather_start_1")
    assert len(first.in_flight) == 1 and not second.in_flight
    with pytest.raises(RuntimeError, match="all_gather_start_1.*nothing in flight"):
        second.wait(gathered, started="all_gather_start_1")
    assert first.wait(gathered, started="all_gather_start_1") is gathered
    assert not first.in_flight


def test_no_module_level_runtime_state():
    """The comm, copy engine and kernels an op runs with come from its executable's context:
    nothing a program run installs globally, nothing keyed by a tensor's address."""
    for module, names in [
        (zerocc.engine.comm, ("use_comm", "active_comm", "_ACTIVE")),
        (zerocc.engine.transfers, ("use_transfers", "active_transfers", "_active")),
        (zerocc.backends.eager.ops, ("use_kernels", "active_kernels", "_pending", "_kernels")),
    ]:
        assert not [n for n in names if hasattr(module, n)], module.__name__


def test_bound_program_calls_the_executables_ops_and_reads_as_the_program():
    step = zerocc.compile(_model(), PLAN, loss_fn=_loss, comm=FakeComm(2))
    step(torch.randn(4, 8))
    ops = EagerOps(_context())
    bound = bind(step.program, ops)
    program_nodes = [(n.name, op_name(n.target)) for n in step.program.graph.nodes]
    assert [(n.name, op_name(n.target)) for n in bound.graph.nodes] == program_nodes
    waits = [n for n in bound.graph.nodes if op_name(n.target) == "zerocc.wait"]
    assert waits and all(n.kwargs["started"] == n.args[0].name for n in waits)
    assert all(getattr(n.target, "__self__", None) is None for n in waits)  # plain functions
    # The program itself is untouched: its ops are still zerocc's schemas.
    assert all(
        isinstance(n.target, torch._ops.OpOverload)
        for n in step.program.graph.nodes
        if n.op == "call_function" and op_name(n.target).startswith("zerocc.")
    )


def test_a_failed_run_leaves_nothing_in_flight_for_the_next():
    """A collective that fails midway through a cached program's run, at each point of its
    schedule: the executable forgets what the run left in flight (at some points a prefetched
    gather is), and the next run is clean."""

    class Failing(FakeComm):
        at, calls = 0, 0

        def _collective(self, run):
            Failing.calls += 1
            if Failing.calls == Failing.at:
                in_flight_at_failure.append(sum(p.run.in_flight() for p in step.programs.values()))
                raise RuntimeError("injected collective failure")
            return run()

        def _all_gather(self, out, shard):
            return self._collective(lambda: super(Failing, self)._all_gather(out, shard))

        def _reduce_scatter(self, out, full):
            return self._collective(lambda: super(Failing, self)._reduce_scatter(out, full))

        def _all_reduce(self, tensor):
            return self._collective(lambda: super(Failing, self)._all_reduce(tensor))

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )
    plan = {**PLAN, "units": {"classes": ["Linear"]}}
    step = zerocc.compile(model, plan, loss_fn=_loss, comm=Failing(2))
    step(torch.randn(4, 8))  # cached: its executable is reused by every run below
    collectives = Failing.calls
    in_flight_at_failure: list[int] = []
    for at in range(1, collectives + 1):
        Failing.at, Failing.calls = at, 0
        with pytest.raises(RuntimeError, match="injected"):
            step(torch.randn(4, 8))
        assert [p.run.in_flight() for p in step.programs.values()] == [0]
    assert max(in_flight_at_failure) > 0  # some failure point did leave a handle behind
    Failing.at = 0
    step(torch.randn(4, 8))


def test_a_registered_backend_runs_plans_that_name_it_and_profiles_what_it_made():
    compiled = []

    def counting(program, example_inputs, ctx):
        compiled.append(len(example_inputs))
        return eager.compile(program, example_inputs, ctx)

    register_backend("counting", counting)
    try:
        plan = {**PLAN, "backend": {"device": "cpu", "name": "counting"}}
        assert _losses(plan) == _losses(PLAN)  # the same executable: bit-identical
        assert compiled  # one per program
        step = zerocc.compile(_model(), plan, loss_fn=_loss, comm=FakeComm(2))
        step(torch.randn(4, 8))
        before = len(compiled)
        step.profile(torch.randn(4, 8))
        assert len(compiled) == before  # the program's own executable, interpreted
        other = FakeComm(2)
        step.profile(torch.randn(4, 8), comm=other)
        assert len(compiled) == before + 1  # bound to another comm: lowered by the backend again
        step.profile(torch.randn(4, 8), comm=other)
        assert len(compiled) == before + 1  # once: kept for the next profile there
        step.profile(torch.randn(4, 8), backend="eager")
        assert len(compiled) == before + 1  # the backend asked for lowers it, not the plan's
    finally:
        del BACKENDS["counting"]


def test_an_unregistered_backend_is_a_plan_error_naming_the_registered_ones():
    plan = {**PLAN, "backend": {"device": "cpu", "name": "inductorr"}}
    with pytest.raises(zerocc.PlanError, match="'inductorr' is not a registered backend.*eager"):
        zerocc.compile(_model(), plan, loss_fn=_loss, comm=FakeComm(2))


def test_a_profiled_run_is_checked_on_the_executable_that_ran():
    """Profiling on another comm (calibration's) runs the program on an executable of its own:
    what that one leaves in flight is the error, not what the step's (idle) executable holds."""

    class Leaky:
        def __init__(self, inner):
            self.inner, self.gm = inner, inner.gm

        def __call__(self, *args):
            return self.inner(*args)

        def in_flight(self):
            return 1  # as if a collective were never waited on

        def reset(self):
            self.inner.reset()

        def lowering(self):
            return self.inner.lowering()

        def notes(self):
            return []

        def artifacts(self):
            return {}

    built = []

    def leaky_after_the_first(program, example_inputs, ctx):
        executable = eager.compile(program, example_inputs, ctx)
        built.append(executable)
        return executable if len(built) == 1 else Leaky(executable)

    register_backend("leaky", leaky_after_the_first)
    try:
        plan = {**PLAN, "backend": {"device": "cpu", "name": "leaky"}}
        step = zerocc.compile(_model(), plan, loss_fn=_loss, comm=FakeComm(2))
        step(torch.randn(4, 8))  # the step's own executable: clean
        step.profile(torch.randn(4, 8))  # on the step's comm: the step's executable, clean
        with pytest.raises(RuntimeError, match="collectives still in flight"):
            step.profile(torch.randn(4, 8), comm=FakeComm(2))
    finally:
        del BACKENDS["leaky"]


def test_a_registered_name_is_not_replaced():
    with pytest.raises(ValueError, match="'eager' is already registered"):
        register_backend("eager", eager.compile)
    assert BACKENDS["eager"] is eager.compile


def test_auto_is_inductor_by_regions_on_a_gpu_and_eager_on_a_cpu():
    assert resolve_backend("auto", torch.device("cuda", 0)) == "inductor"
    assert resolve_backend("auto", torch.device("cpu")) == "eager"
    assert resolve_backend("inductor", torch.device("cpu")) == "inductor"
    with pytest.raises(ValueError, match="'auto' is already registered"):
        register_backend("auto", eager.compile)
    plan = {**PLAN, "backend": {"device": "cpu", "name": "auto"}}
    step = zerocc.compile(_model(), plan, loss_fn=_loss, comm=FakeComm(2))
    assert _losses(plan) == _losses(PLAN)  # the eager backend itself: bit-identical
    step(torch.randn(4, 8))
    assert step.record().backend == "eager"
    assert "backend eager (auto) on cpu" in step.explain()
