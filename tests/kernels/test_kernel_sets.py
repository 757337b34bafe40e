"""Choosing a kernel set: ``backend.kernels: triton`` where triton is missing or older than the
kernels are verified with is a NotSupportedError at compile time that says what to install;
zerocc itself does not depend on triton (it runs without it); ``auto`` picks Triton only where
it runs compiled."""

from __future__ import annotations

import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

import zerocc
from zerocc.backends.kernels import resolve_kernels
from zerocc.errors import NotSupportedError

PLAN = {"backend": {"kernels": "triton", "device": "cpu"}}


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
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    for extra in ("triton", "dev"):  # dev: the kernel tests run interpreted on CPU
        assert [d for d in project["optional-dependencies"][extra] if d.startswith("triton")]


def test_auto_picks_triton_only_where_it_runs_compiled(monkeypatch):
    """``backend.kernels: auto`` (the default): Triton on a GPU with fp32 masters, the torch
    reference on a CPU (where Triton only interprets), with bf16 masters (the Triton update
    writes fp32 ones), or without a usable Triton; a named set is itself."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    assert resolve_kernels("auto", gpu, "fp32") == "triton"
    assert resolve_kernels("auto", gpu, "bf16") == "torch"
    assert resolve_kernels("auto", cpu, "fp32") == "torch"
    assert resolve_kernels("triton", cpu, "fp32") == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails
    assert resolve_kernels("auto", gpu, "fp32") == "torch"


def test_a_default_plan_on_cpu_says_it_runs_the_torch_kernels():
    step = zerocc.compile(
        torch.nn.Linear(4, 1), {"backend": {"device": "cpu"}}, loss_fn=lambda m, x: m(x).sum()
    )
    step(torch.ones(2, 4))
    assert step.record().kernels == "torch"
    assert "kernels torch (auto: torch ops: Triton kernels need a GPU" in step.explain()
