"""Choosing a kernel set: ``backend.kernels: triton`` where triton is missing or older than the
kernels are verified with is a NotSupportedError at compile time that says what to install;
zerocc itself does not depend on triton (it runs without it); ``auto`` picks the fastest set
that runs on the device. Every set implements the one interface, :class:`KernelSet`."""

from __future__ import annotations

import inspect
import sys
import tomllib
import types
from pathlib import Path

import optional_deps
import pytest
import torch

import zerocc
from zerocc.backends.kernels import KERNEL_SETS, fused, kernel_set, resolve_kernels
from zerocc.engine.kernel_set import KernelSet
from zerocc.errors import NotSupportedError

PLAN = {"backend": {"kernels": "triton", "device": "cpu"}}


def _members(protocol: type) -> dict[str, list[str]]:
    """The protocol's methods and their parameters (less ``self``), in order."""
    return {
        name: list(inspect.signature(fn).parameters)[1:]
        for name, fn in vars(protocol).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize("name", sorted(KERNEL_SETS))
def test_every_kernel_set_implements_the_interface(name):
    if name == "triton" and optional_deps.TRITON_PROBLEM is not None:
        pytest.skip(optional_deps.TRITON_REASON)
    module = kernel_set(name)
    members = _members(KernelSet)
    assert set(members) == {
        "runs_on",
        "adamw_",
        "sgd_",
        "unscale_check_",
        "nonfinite_flags",
        "pack",
    }
    for member, parameters in members.items():
        assert callable(getattr(module, member, None)), f"{name} has no {member}"
        assert list(inspect.signature(getattr(module, member)).parameters) == parameters, (
            f"{name}.{member} takes other parameters than KernelSet.{member}"
        )
    assert isinstance(module.runs_on("cpu"), bool)


def _compile_with(monkeypatch: pytest.MonkeyPatch, triton: types.ModuleType | None) -> str:
    """The error of compiling a triton plan (interpreted, on CPU) where ``import triton`` gives
    ``triton`` (None: the import fails)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", triton)
    with pytest.raises(NotSupportedError) as error:
        zerocc.compile(torch.nn.Linear(4, 1), PLAN, loss_fn=lambda m, x: m(x).pow(2).mean())
    return str(error.value)


def test_a_triton_plan_without_triton_names_the_install_command(monkeypatch):
    message = _compile_with(monkeypatch, None)
    assert message.startswith("backend.kernels: triton, but triton cannot be imported"), message
    assert "`pip install triton`" in message and '`pip install -e ".[triton]"`' in message
    assert message.endswith("or use backend.kernels: torch"), message


def test_a_triton_older_than_the_verified_one_is_refused(monkeypatch):
    old = types.ModuleType("triton")
    old.__version__ = "3.0.0"  # what torch 2.4 brings: its interpreter computes wrong updates
    message = _compile_with(monkeypatch, old)
    assert "zerocc's Triton kernels need triton >= 3.3, found 3.0.0" in message, message
    assert "or use backend.kernels: torch" in message


def test_zerocc_installs_without_triton_and_its_extras_bring_it():
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    for extra in ("triton", "dev"):  # dev: the kernel tests run interpreted on CPU
        assert [d for d in project["optional-dependencies"][extra] if d.startswith("triton")]


def test_auto_picks_the_fastest_set_that_runs_here(monkeypatch):
    """``backend.kernels: auto`` (the default): Triton on a GPU with fp32 masters; torch's fused
    kernels on a CPU (where Triton only interprets) or without a usable Triton; the reference
    with bf16 masters (which neither fused set writes); a named set is itself."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    assert resolve_kernels("auto", gpu, "fp32") == "triton"
    assert resolve_kernels("auto", gpu, "bf16") == "torch"
    assert resolve_kernels("auto", cpu, "fp32") == "fused"
    assert resolve_kernels("auto", cpu, "bf16") == "torch"
    assert resolve_kernels("triton", cpu, "fp32") == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails
    monkeypatch.setattr(fused, "runs_on", lambda device_type: device_type == "cpu")
    assert resolve_kernels("auto", gpu, "fp32") == "torch"
    assert resolve_kernels("auto", cpu, "fp32") == "fused"
    monkeypatch.setattr(fused, "runs_on", lambda device_type: False)  # a torch without them
    assert resolve_kernels("auto", cpu, "fp32") == "torch"


def test_a_default_plan_on_cpu_says_it_runs_torchs_fused_kernels():
    step = zerocc.compile(
        torch.nn.Linear(4, 1), {"backend": {"device": "cpu"}}, loss_fn=lambda m, x: m(x).sum()
    )
    step(torch.ones(2, 4))
    assert step.record().kernels == "fused"
    assert "kernels fused (auto: torch's fused optimizer kernels" in step.explain()


def test_one_pass_off_the_cpu_or_where_it_cannot_compile_is_refused(monkeypatch):
    from zerocc.backends.kernels import check_kernels, one_pass

    with pytest.raises(NotSupportedError, match="one-pass updates on the CPU.*use it already"):
        check_kernels("one-pass", torch.device("cuda", 0))
    monkeypatch.setattr(one_pass, "problem", lambda: "CppCompileError: no C++ compiler")
    with pytest.raises(NotSupportedError, match="cannot compile here .CppCompileError.*fused"):
        check_kernels("one-pass", torch.device("cpu"))
