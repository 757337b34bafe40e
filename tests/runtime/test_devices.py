"""Which device each rank runs on (zerocc/runtime/devices.py), on this CPU machine with GPUs faked:
rank i of a machine on cuda:i; a plan that needs more GPUs than the machine has is a
DeviceError on every rank, before anything touches CUDA, and `zerocc train` says so before it
starts any rank; CPU plans stay on the CPU whatever the machine has."""

from __future__ import annotations

import pytest
import torch

import zerocc
from zerocc.cli.main import main
from zerocc.compiler.plan import load_plan
from zerocc.cost.rates import device_kind
from zerocc.errors import DeviceError, PlanError
from zerocc.runtime.devices import rank_device

LINEAR = {"loss_fn": lambda m, x: m(x).pow(2).mean()}


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)`` fakes a machine with n GPUs: torch.cuda says so, and anything else that would
    touch CUDA fails the test."""

    import torch._dynamo

    # torch._dynamo maps torch's functions to rules once, on first use: from the real ones.
    getattr(torch._dynamo.trace_rules, "get_torch_obj_rule_map", lambda: None)()

    def machine(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

        for name in ("set_device", "_lazy_init", "current_device", "mem_get_info"):
            monkeypatch.setattr(torch.cuda, name, _fails(name))

    return machine


def _fails(name: str):
    """A stand-in for ``torch.cuda.<name>``, one function per name (torch._dynamo refuses one
    object under two names)."""

    def touched(*args, **kwargs):
        raise AssertionError(f"torch.cuda.{name} was called before the device check")

    return touched


def _launched_as(monkeypatch, local_rank: int, local_ranks: int) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))


def test_each_rank_runs_on_the_gpu_of_its_local_rank(gpus, monkeypatch):
    gpus(2)
    for local_rank in (0, 1):
        _launched_as(monkeypatch, local_rank, 2)
        for device in ("auto", "cuda"):
            plan = load_plan({"backend": {"device": device}})
            assert rank_device(plan) == torch.device("cuda", local_rank)


@pytest.mark.parametrize("device", ["auto", "cuda"])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_two_ranks_on_one_gpu_fail_on_every_rank_before_cuda_is_touched(
    gpus, monkeypatch, device, local_rank
):
    gpus(1)
    _launched_as(monkeypatch, local_rank, 2)
    with pytest.raises(DeviceError) as error:
        zerocc.compile(torch.nn.Linear(4, 1), {"backend": {"device": device}}, **LINEAR)
    message = str(error.value)
    assert f"backend.device: '{device}'" in message
    assert "2 ranks run on this machine, but it has 1 GPU(s) visible" in message
    assert "`zerocc train --nproc 1`" in message and "backend.device: cpu" in message


def test_a_rank_beyond_the_gpus_fails_without_the_local_world_size(gpus, monkeypatch):
    """A launcher that sets LOCAL_RANK alone: the rank it names must have a GPU."""
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(DeviceError, match="2 ranks run on this machine"):
        rank_device(load_plan({}))


def test_cuda_on_a_machine_without_one_is_a_plan_error(gpus):
    gpus(0)
    with pytest.raises(PlanError, match="'cuda' asked for, but no CUDA device is available"):
        zerocc.compile(torch.nn.Linear(4, 1), {"backend": {"device": "cuda"}}, **LINEAR)
    assert rank_device(load_plan({})) == torch.device("cpu")
    assert device_kind(load_plan({})) == "cpu"


def test_cpu_ranks_on_a_gpu_machine_stay_on_the_cpu(gpus, monkeypatch):
    gpus(1)
    _launched_as(monkeypatch, 1, 2)
    step = zerocc.compile(torch.nn.Linear(4, 1), {"backend": {"device": "cpu"}}, **LINEAR)
    assert step.device == torch.device("cpu")
    assert float(step(torch.ones(2, 4))) >= 0
    assert device_kind(load_plan({})) == "cuda"  # what `auto` estimates for: this machine's


def test_the_launcher_checks_every_rank_has_a_gpu_before_starting_any(
    gpus, monkeypatch, tmp_path, capsys
):
    from zerocc.runtime import launch

    gpus(1)
    monkeypatch.delenv("ZEROCC_RANK_WORKER", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(launch, "launch", lambda *a: pytest.fail("ranks were started"))
    plan = tmp_path / "plan.yaml"
    plan.write_text("zero: {stage: 3}\n")
    assert main(["train", str(plan), "--nproc", "2"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("zerocc: error: backend.device: 'auto' (this machine has a GPU)")
    assert "2 ranks run on this machine, but it has 1 GPU(s)" in error
