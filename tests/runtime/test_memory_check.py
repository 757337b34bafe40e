"""The memory check before training: a plan that cannot fit fails before it allocates, with the
shortfall and plan changes that fit (each verified here to fit), on faked machine figures;
backend.check_memory: false goes on; a real meta-device model too large for this machine fails
on the real figures without allocating anything."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from model import GPT, GPTConfig
from models import build
from multirank import run_ranks
from parity import batch_of

import zerocc
import zerocc.runtime.state_store as state_store
from zerocc.compiler.capture import describe_model
from zerocc.compiler.driver.pass_manager import bind_passes, plan_layout
from zerocc.compiler.driver.plan_changes import NVME_PATH_HINT
from zerocc.compiler.driver.program import compile_program
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.passes.partition import assign_units
from zerocc.compiler.plan import load_plan
from zerocc.errors import InsufficientMemoryError
from zerocc.ir.quantities import human_bytes
from zerocc.runtime import machine_memory, memory_check
from zerocc.runtime.machine_memory import DEVICE_POOL, HOST_POOL
from zerocc.runtime.pipeline import microbatches_of

GPT_PLAN = {"units": {"classes": ["Block"]}, "optimizer": {"eps": 1e-3}}
CPU = torch.device("cpu")
BATCH = batch_of({"model": "gpt"}, 0, 0)
_ROW = re.compile(r"^  fits\s+(?:host|device) .*?B\s{2,}(\S.*)$")


class FakeMachine:
    """Stands in for ``machine_memory.available_memory``: returns ``figures`` in turn (the last
    one from then on) and counts the reads."""

    def __init__(self, *figures: dict[str, int]) -> None:
        self.figures, self.reads = list(figures), 0

    def __call__(self, device: torch.device) -> dict[str, int]:
        self.reads += 1
        return dict(self.figures[min(self.reads, len(self.figures)) - 1])


@pytest.fixture
def machine(monkeypatch):
    """Install a FakeMachine: ``machine(*figures)``."""

    def install(*figures: dict[str, int]) -> FakeMachine:
        fake = FakeMachine(*figures)
        monkeypatch.setattr(machine_memory, "available_memory", fake)
        return fake

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return install


@pytest.fixture
def allocations(monkeypatch):
    """The layouts allocate_state was called with (each call goes through)."""
    calls = []
    real = state_store.allocate_state

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(state_store, "allocate_state", counting)
    return calls


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return build("gpt")


def _states_need(model: torch.nn.Module, plan: dict, world: int, device=CPU) -> dict[str, int]:
    """What check 1 predicts per rank and pool for ``plan`` on ``world`` ranks."""
    info, plan = describe_model(model), load_plan(plan)
    units = assign_units(info, world, plan.units.classes, plan.units.modules, plan.units.min_mb)
    need = memory_check.model_state_need(info, units, plan_layout(plan, units), device)
    return {pool: sum(parts.values()) for pool, parts in need.items()}


def _step_program(plan, world: int):
    """The stepping program of ``plan`` (compiled on the CPU, as the estimate does for any
    device)."""
    plan, model = load_plan(plan) if isinstance(plan, dict) else plan, build("gpt")
    return compile_program(
        model,
        describe_model(model),
        plan,
        bind_passes(plan),
        BATCH,
        loss_fn=None,
        device=CPU,
        mesh=Mesh.of_plan(plan, world),
        boundary=True,
    ).gm


def _step_need(plan: dict, world: int, gloo: bool = False) -> int:
    """What check 2 predicts per rank for the stepping program of ``plan`` (host pool, CPU;
    ``gloo``: for ranks on gloo, not the FakeComm these tests run on)."""
    need = memory_check.step_need(_step_program(plan, world), CPU, gloo=gloo)
    return sum(need[HOST_POOL].values())


def _fitting_changes(message: str) -> list[str]:
    """The plan changes the message marks as fitting, as written there."""
    return [m.group(1) for line in message.splitlines() if (m := _ROW.match(line))]


def _apply(plan: dict, change: str, nvme_path: str) -> tuple[dict, int | None]:
    """``plan`` with a change of the message applied (fields, or a world size)."""
    ranks = re.match(r"(\d+) ranks", change)
    if ranks:
        return plan, int(ranks.group(1))
    changed = yaml.safe_load(yaml.safe_dump(plan))
    for field in change.split(", "):
        path, value = field.split(": ", 1)
        value = nvme_path if value == NVME_PATH_HINT else yaml.safe_load(value)
        *parents, leaf = path.split(".")
        node = changed
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return changed, None


def test_states_that_do_not_fit_fail_before_any_state_is_allocated(machine, allocations, tmp_path):
    plan = {**GPT_PLAN, "zero": {"stage": 1}}
    need = _states_need(_meta_gpt(), plan, world=2)[HOST_POOL]
    available = need * 85 // 100
    machine({HOST_POOL: available})
    model = _meta_gpt()
    with pytest.raises(InsufficientMemoryError) as raised:
        zerocc.compile(model, plan, comm=zerocc.FakeComm(2))
    assert allocations == [] and all(p.is_meta for p in model.parameters())
    message = str(raised.value)
    assert f"= {human_bytes(need)}" in message
    assert f"short by {human_bytes(need - available)}" in message
    assert "backend.check_memory: false" in message
    changes = _fitting_changes(message)
    assert "zero.stage: 3" in changes and any(re.match(r"\d+ ranks", c) for c in changes)
    assert any("offload.optimizer: nvme" in c for c in changes)
    for change in changes:  # each one the message says fits does
        changed, ranks = _apply(plan, change, str(tmp_path))
        step = zerocc.compile(_meta_gpt(), changed, comm=zerocc.FakeComm(ranks or 2))
        assert step.state and allocations[-1] == plan_layout(load_plan(changed), step.units)


def test_no_world_size_fits_what_stage_0_keeps_whole(machine):
    need = _states_need(_meta_gpt(), GPT_PLAN, world=2)[HOST_POOL]
    machine({HOST_POOL: need // 2})
    with pytest.raises(InsufficientMemoryError, match="no world size fits"):
        zerocc.compile(_meta_gpt(), {**GPT_PLAN, "zero": {"stage": 0}}, comm=zerocc.FakeComm(2))


def test_a_step_that_does_not_fit_fails_before_its_program_runs(machine, allocations):
    # Stage 3: without gradient accumulation the tiny GPT's stage 1-2 steps peak while the last
    # block's gradients are packed for their reduction, which recomputation does not lower.
    plan = {**GPT_PLAN, "zero": {"stage": 3}}
    recomputed = {**plan, "recompute": {"units": "all"}}
    step_bytes, recomputed_bytes = _step_need(plan, 2), _step_need(recomputed, 2)
    assert recomputed_bytes < step_bytes
    available = (step_bytes + recomputed_bytes) // 2
    fake = machine({HOST_POOL: 2**40}, {HOST_POOL: available})  # the states fit, the step not
    step = zerocc.compile(build("gpt"), plan, comm=zerocc.FakeComm(2))
    backends = []
    real_backend = step.builder.backend
    step.builder.backend = lambda gm: backends.append(gm) or real_backend(gm)
    weights = {k: t.clone() for k, t in step.state.items()}
    with pytest.raises(InsufficientMemoryError) as raised:
        step(*BATCH)
    assert fake.reads == 2 and backends == [] and step.micro_batches == 0
    assert all(torch.equal(weights[k], t) for k, t in step.state.items())
    message = str(raised.value)
    assert "training step of this plan does not fit" in message
    assert f"short by {human_bytes(step_bytes - available)}" in message
    assert "recompute.units: all" in _fitting_changes(message)
    machine({HOST_POOL: 2**40}, {HOST_POOL: available})
    step = zerocc.compile(build("gpt"), recomputed, comm=zerocc.FakeComm(2))
    assert torch.isfinite(step(*BATCH))


def test_check_memory_false_goes_on(machine):
    fake = machine({HOST_POOL: 1})
    plan = {**GPT_PLAN, "backend": {"check_memory": False}}
    step = zerocc.compile(build("gpt"), plan, comm=zerocc.FakeComm(2))
    assert torch.isfinite(step(*BATCH)) and fake.reads == 0


def test_a_plan_that_fits_passes_on_this_machines_figures(monkeypatch):
    reads = []
    real = machine_memory.available_memory

    def reading(device):
        reads.append(real(device))
        return reads[-1]

    monkeypatch.setattr(machine_memory, "available_memory", reading)
    step = zerocc.compile(build("gpt"), GPT_PLAN, comm=zerocc.FakeComm(2))
    assert torch.isfinite(step(*BATCH))
    assert len(reads) == 2 and all(r[HOST_POOL] > 2**20 for r in reads)


def test_every_local_rank_counts_against_host_memory(machine, monkeypatch):
    need = _states_need(_meta_gpt(), GPT_PLAN, world=4)[HOST_POOL]
    machine({HOST_POOL: 3 * need})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(InsufficientMemoryError, match=rf"× 4 ranks = {human_bytes(4 * need)}"):
        zerocc.compile(_meta_gpt(), GPT_PLAN, comm=zerocc.FakeComm(4))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    zerocc.compile(_meta_gpt(), GPT_PLAN, comm=zerocc.FakeComm(4))


def test_on_a_gpu_device_states_may_move_to_host_memory(machine):
    """The pools of a GPU run (no GPU needed: the check reads only the device's kind)."""
    model, gpu = _meta_gpt(), torch.device("cuda", 0)
    plan = {**GPT_PLAN, "zero": {"stage": 3}}
    need = _states_need(model, plan, 2, gpu)
    machine({DEVICE_POOL: need[DEVICE_POOL] * 2 // 3, HOST_POOL: 2**40})
    info, plan_model = describe_model(model), load_plan(plan)
    units = assign_units(info, 2, ["Block"], [], None)
    with pytest.raises(InsufficientMemoryError) as raised:
        layout = plan_layout(plan_model, units)
        memory_check.check_model_states(info, units, layout, plan_model, zerocc.FakeComm(2), gpu)
    message = str(raised.value)
    assert "memory of cuda:0: per rank" in message
    changes = _fitting_changes(message)
    assert "offload.optimizer: cpu" in changes
    for change in changes:
        changed, ranks = _apply(plan, change, "/unused")
        fitted = _states_need(model, changed, ranks or 2, gpu)
        assert fitted[DEVICE_POOL] <= need[DEVICE_POOL] * 2 // 3


def test_host_buffers_that_do_not_fit_may_keep_the_gradients_on_the_gpu(machine):
    """An offloaded optimizer's step on a GPU whose gradients' host buffers do not fit in host
    memory: the check proposes offload.grads: device, which fits (the device has room)."""
    gpu = torch.device("cuda", 0)
    plan = {**GPT_PLAN, "zero": {"stage": 3}, "offload": {"optimizer": "cpu"}}
    kept = {**plan, "offload": {"optimizer": "cpu", "grads": "device"}}
    host = {
        name: memory_check.step_need(_step_program(p, 2), gpu, gloo=False)[HOST_POOL][
            "host buffers"
        ]
        for name, p in (("cpu", plan), ("device", kept))
    }
    assert host["device"] < host["cpu"]
    machine({DEVICE_POOL: 2**40, HOST_POOL: (host["cpu"] + host["device"]) // 2})
    info, plan_model = describe_model(build("gpt")), load_plan(plan)
    units = assign_units(info, 2, ["Block"], [], None)
    layout = plan_layout(plan_model, units)
    with pytest.raises(InsufficientMemoryError) as raised:
        memory_check.check_step_memory(
            _step_program(plan_model, 2),
            units,
            layout,
            plan_model,
            zerocc.FakeComm(2),
            gpu,
            lambda changed: _step_program(changed, 2),
        )
    assert "offload.grads: device" in _fitting_changes(str(raised.value))


def _too_much_for_two_ranks(rank: int, world: int, per_rank: int) -> None:
    import zerocc as z
    from zerocc.runtime import machine_memory as memory

    memory.available_memory = lambda device: {HOST_POOL: 3 * per_rank // 2}
    z.compile(_meta_gpt(), {**GPT_PLAN, "backend": {"device": "cpu"}})


def test_ranks_sharing_a_machine_fail_together():
    """Two gloo ranks, no LOCAL_WORLD_SIZE: the ranks count each other by host name, and
    both raise (no rank goes on to wait for the other)."""
    per_rank = _states_need(_meta_gpt(), GPT_PLAN, world=2)[HOST_POOL]
    with pytest.raises(RuntimeError) as raised:
        run_ranks(2, _too_much_for_two_ranks, per_rank, timeout=120)
    errors = raised.value.errors
    assert sorted(errors) == [0, 1]
    assert {kind for kind, _ in errors.values()} == {"InsufficientMemoryError"}
    assert errors[0][1] == errors[1][1] and "× 2 ranks" in errors[0][1]


def test_a_model_larger_than_this_machine_fails_on_its_real_figures(monkeypatch):
    """~32B parameters on the meta device, stage 0 on one rank: ~480 GiB of states."""
    reached = []
    monkeypatch.setattr(state_store, "allocate_state", lambda *a, **k: reached.append(a) or {})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = GPTConfig(vocab_size=32000, block_size=64, n_layer=40, n_head=64, n_embd=8192)
    with torch.device("meta"):
        model = GPT(config)
    plan = {**GPT_PLAN, "zero": {"stage": 0}}
    with pytest.raises(InsufficientMemoryError, match="short by") as raised:
        zerocc.compile(model, plan, comm=zerocc.FakeComm(1))
    assert reached == [] and all(p.is_meta for p in model.parameters())
    available = re.search(r"available: ([\d.]+)GiB", str(raised.value))
    assert available and float(available.group(1)) * 2**30 <= 1.01 * machine_memory.host_available()


def _pipeline_plan(schedule: str, **extra) -> dict:
    return {
        **GPT_PLAN, "parallel": {"pp": 2}, "backend": {"device": "cpu"},
        "pipeline": {"schedule": schedule, "microbatches": 8}, **extra,
    }  # fmt: skip


def test_a_pipeline_rank_that_does_not_fit_fails_before_it_allocates(machine, allocations):
    """A pipeline rank's predicted peak (model states, what GPipe keeps for all 8 micro-batches,
    the running program) against a machine of 1 byte more than 1F1B's: GPipe is refused
    before anything is allocated, naming the rank's stages and 1F1B, which fits."""
    batch = tuple(torch.cat([b] * 4) for b in BATCH)  # 8 micro-batches of 2
    fits = zerocc.compile(build("gpt"), _pipeline_plan("1f1b"), comm=zerocc.FakeComm(2))
    machine({HOST_POOL: 1 << 40})
    fits.pipeline._build(microbatches_of(batch, 8)[0])  # (its programs: no step on a FakeComm)
    room = fits.memory().peak
    machine({HOST_POOL: room + 1})
    allocations.clear()
    step = zerocc.compile(build("gpt"), _pipeline_plan("gpipe"), comm=zerocc.FakeComm(2))
    with pytest.raises(InsufficientMemoryError) as refused:
        step(*batch)
    message = str(refused.value)
    assert "this pipeline rank's stages [0] do not fit in memory" in message
    assert f"pipeline.schedule: 1f1b: this rank's peak {human_bytes(room)} (fits)" in message
    assert "8 forward(s) awaiting their backward" in message
    assert "\n  pipeline.gather: microbatch (each stage's parameters gathered per" in message
    assert not allocations
    off = {"backend": {"device": "cpu", "check_memory": False}}
    zerocc.compile(build("gpt"), _pipeline_plan("gpipe", **off), comm=zerocc.FakeComm(2))


def test_gpu_states_are_checked_before_launch_on_nvmls_figures(machine):
    """`zerocc train` on GPUs checks its local ranks' model states against each GPU's free
    memory as NVML reports it (no CUDA context: no GPU needed here, NVML's answer is given),
    and leaves the check to the ranks where NVML cannot answer."""
    from zerocc.compiler.driver.session import CompileSession

    model, gpu = _meta_gpt(), torch.device("cuda", 0)
    plan = load_plan({**GPT_PLAN, "zero": {"stage": 3}})
    need = _states_need(model, GPT_PLAN | {"zero": {"stage": 3}}, 2, gpu)
    machine({HOST_POOL: 2**40})
    session = CompileSession.open(model, plan, 2)
    asked = []

    def nvml_says(free: dict[int, int] | None):
        return lambda indices: asked.append(indices) or free

    check = memory_check.check_states_before_launch
    room = need[DEVICE_POOL] * 3 // 2
    check(session, plan, 2, 0, "cuda", nvml_says({0: room, 1: room}))
    with pytest.raises(InsufficientMemoryError, match=r"(?s)rank 1, .*memory of cuda:1: per rank"):
        check(session, plan, 2, 0, "cuda", nvml_says({0: room, 1: need[DEVICE_POOL] * 2 // 3}))
    check(session, plan, 2, 0, "cuda", nvml_says(None))  # the ranks will check
    assert asked == [[0, 1]] * 3


class FakeNvml:
    """Stands in for ``libnvidia-ml.so.1``: device ``i`` has ``free[i]`` bytes free."""

    def __init__(self, free: list[int], init: int = 0) -> None:
        self.free, self.init, self.shut = free, init, False

    def nvmlInit_v2(self) -> int:
        return self.init

    def nvmlShutdown(self) -> int:
        self.shut = True
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: int, handle) -> int:
        if index >= len(self.free):
            return 2  # NVML_ERROR_INVALID_ARGUMENT
        handle._obj.value = index + 1
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory) -> int:
        memory._obj.free = self.free[handle.value - 1]
        memory._obj.total = 2 * memory._obj.free
        return 0


def test_nvml_reads_each_gpus_free_memory_or_says_it_cannot():
    from zerocc.runtime import nvml

    fake = FakeNvml([5 << 30, 7 << 30])
    assert nvml.free_bytes([0, 1], lambda: fake) == {0: 5 << 30, 1: 7 << 30}
    assert fake.shut
    assert nvml.free_bytes([0, 2], lambda: FakeNvml([1])) is None  # no third GPU
    assert nvml.free_bytes([0], lambda: FakeNvml([1], init=9)) is None  # no driver loaded

    def missing():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert nvml.free_bytes([0], missing) is None
