"""Tests of zerocc/compiler/workload.py: the workload a plan names, looked up next to the plan
file before installed packages, never in the current directory."""

import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zerocc.compiler.plan import load_plan
from zerocc.compiler.workload import Workload, load_workload
from zerocc.errors import PlanError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"


def write(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


WORKLOAD_PY = """
import torch
from zerocc.compiler.workload import Workload

def make(width=3):
    return Workload(torch.nn.Linear(width, 1), batches=lambda rank, world_size: iter([]))

def not_a_workload():
    return 42
"""


def test_load_workload_next_to_the_plan(tmp_path):
    write(tmp_path, WORKLOAD_PY, "workload.py")
    plan = load_plan(write(tmp_path, "workload: workload:make\nworkload_args: {width: 5}\n"))
    workload = load_workload(plan)
    assert isinstance(workload, Workload) and workload.model.in_features == 5


def test_load_workload_prefers_the_plan_directory_over_a_cached_module(tmp_path):
    for width, sub in [(2, "a"), (4, "b")]:
        (tmp_path / sub).mkdir()
        write(tmp_path / sub, WORKLOAD_PY.replace("width=3", f"width={width}"), "workload.py")
        plan = load_plan(write(tmp_path / sub, "workload: workload:make\n"))
        assert load_workload(plan).model.in_features == width


@pytest.mark.parametrize(
    ("plan_text", "expected"),
    [
        ("{}", "names no workload"),
        ("workload: missing_module:make", "cannot import module 'missing_module'"),
        ("workload: workload:nothing", "has no function 'nothing'"),
        (
            "workload: workload:not_a_workload",
            "returned int, not a zerocc.Workload",
        ),
        ("{workload: 'workload:make', workload_args: {depth: 2}}", "workload_args"),
        # (issue 77, case 10) names longer than a file's may be: OSError from plan check
        (f"workload: {'a' * 300}:make", f"cannot import module '{'a' * 300}'"),
        (f"workload: {'a' * 300}.py:make", "cannot be a file: File name too long"),
    ],
)
def test_load_workload_errors(tmp_path, plan_text, expected):
    write(tmp_path, WORKLOAD_PY, "workload.py")
    plan = load_plan(write(tmp_path, plan_text + "\n"))
    with pytest.raises(PlanError, match=expected):
        load_workload(plan)


def test_an_error_of_the_workloads_own_code_names_it_with_its_traceback(tmp_path):
    """... not zerocc's frames, which the user did not write (a model whose arguments do not
    fit printed 11 of zerocc's frames above its own)."""
    write(tmp_path, WORKLOAD_PY + "\ndef broken(width=3):\n    return _check(width)\n\n"
          "def _check(width):\n    raise ValueError(f'width {width} is odd')\n", "workload.py")
    plan = load_plan(write(tmp_path, "workload: workload:broken\nworkload_args: {width: 5}\n"))
    with pytest.raises(PlanError) as raised:
        load_workload(plan)
    said = str(raised.value)
    assert said.startswith(
        "workload: calling workload:broken(**workload_args) raised ValueError: width 5 is odd\n"
    )
    assert "in broken\n    return _check(width)" in said and "in _check\n    raise" in said
    traceback = said.split("\n", 1)[1]  # the workload's frames only, not zerocc's
    assert "load_workload" not in traceback and "workload_code" not in traceback
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_workload_that_imports_what_is_not_installed_when_called_says_so(tmp_path):
    """An ImportError of the workload's call (a dependency imported inside its function) is
    its error like any other; importing the workload's own module says where it searched."""
    write(tmp_path, WORKLOAD_PY + "\ndef late():\n    import not_installed_here\n", "workload.py")
    plan = load_plan(write(tmp_path, "workload: workload:late\n"))
    with pytest.raises(PlanError, match=r"(?s)calling workload:late\(\*\*workload_args\) "
                       r"raised ModuleNotFoundError: No module named 'not_installed_here'\n.*"
                       r"in late\n    import not_installed_here"):
        load_workload(plan)


def _batches_that_fail(rank, world_size):
    raise ValueError(f"shard {rank} of {world_size} is missing")
    yield


def test_an_error_drawing_the_workloads_batches_names_them():
    """... as the commands that compile on rank 0's first batch draw it (and the ranks of
    `zerocc train` theirs, under the same `workload_code`)."""
    from zerocc.inspect.estimate import first_batch

    workload = Workload(nn.Linear(2, 1), batches=_batches_that_fail)
    with pytest.raises(PlanError) as raised:
        first_batch(workload, 2)
    said = str(raised.value)
    assert said.startswith("workload: batches(0, 2) raised ValueError: shard 0 of 2 is missing\n")
    assert said.endswith('in _batches_that_fail\n    raise ValueError(f"shard {rank} of '
                         '{world_size} is missing")')
    none = Workload(nn.Linear(2, 1), batches=lambda rank, world_size: iter([]))
    with pytest.raises(PlanError, match=r"workload: batches\(0, 2\) yielded no batch"):
        first_batch(none, 2)  # (a ValueError `zerocc estimate` printed as a traceback)


@pytest.fixture
def cwd_elsewhere(tmp_path, monkeypatch):
    """Folders a/ (the plan's) and b/ (the current directory, first on sys.path as `python -m`
    puts it, both as '' and as its path)."""
    plan_dir, cwd = tmp_path / "a", tmp_path / "b"
    plan_dir.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", ["", str(cwd), *sys.path])
    return plan_dir, cwd


def test_workload_comes_from_the_plan_folder_before_the_current_directory(cwd_elsewhere):
    plan_dir, cwd = cwd_elsewhere
    write(plan_dir, WORKLOAD_PY.replace("width=3", "width=2"), "workload.py")
    write(cwd, WORKLOAD_PY.replace("width=3", "width=7"), "workload.py")
    plan = load_plan(write(plan_dir, "workload: workload:make\n"))
    assert load_workload(plan).model.in_features == 2


def test_workload_is_never_imported_from_the_current_directory(cwd_elsewhere, monkeypatch):
    plan_dir, cwd = cwd_elsewhere
    write(cwd, WORKLOAD_PY, "cwd_only_workload.py")
    monkeypatch.delitem(sys.modules, "cwd_only_workload", raising=False)
    plan = load_plan(write(plan_dir, "workload: cwd_only_workload:make\n"))
    for _ in range(2):  # the second time with the module imported (from the cwd) by the caller
        with pytest.raises(PlanError) as info:
            load_workload(plan)
        message = str(info.value)
        assert f"searched the plan's folder {plan_dir}, then installed packages" in message
        assert (
            "not the current directory" in message and f"{cwd} holds 'cwd_only_workload'" in message
        )
        __import__("cwd_only_workload")
    assert sys.path[:2] == ["", str(cwd)]  # the search path is restored


def test_workload_of_a_plan_in_the_current_directory(tmp_path, monkeypatch):
    write(tmp_path, WORKLOAD_PY, "here_workload.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "here_workload", raising=False)
    write(tmp_path, "workload: here_workload:make\n")
    plan = load_plan("plan.yaml")  # a relative path: the plan's folder is the current directory
    assert load_workload(plan).model.in_features == 3


def test_a_plan_given_as_a_dict_imports_installed_workloads_only(cwd_elsewhere, monkeypatch):
    plan_dir, cwd = cwd_elsewhere
    write(cwd, WORKLOAD_PY, "dict_workload.py")
    monkeypatch.delitem(sys.modules, "dict_workload", raising=False)
    plan = load_plan({"workload": "dict_workload:make"})
    with pytest.raises(
        PlanError, match=r"installed packages \(sys.path\) \(a plan given as a dict"
    ):
        load_workload(plan)
    write(plan_dir, WORKLOAD_PY, "dict_workload.py")
    monkeypatch.syspath_prepend(str(plan_dir))  # as an installed package is
    assert load_workload(plan).model.in_features == 3


def test_workload_takes_only_the_model_positionally():
    with pytest.raises(TypeError):
        Workload(nn.Linear(1, 1), None, lambda rank, world_size: iter([]))


def test_gpt_example_loss_starts_near_uniform():
    plan = load_plan(EXAMPLES / "zero3.yaml")
    plan.workload_args.update(n_layer=1, n_embd=32, block_size=16, batch_size=2)
    workload = load_workload(plan)
    idx, targets = next(workload.batches(1, 2))
    assert idx.shape == targets.shape == (2, 16) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    vocab = workload.model.lm_head.out_features
    assert workload.model.lm_head.weight is workload.model.transformer.wte.weight
    assert abs(workload.model(idx, targets).item() - math.log(vocab)) < 0.5


NOISY_IMPORT_PY = """
import logging
import torch
from zerocc.compiler.workload import Workload

# what importing torchao says where its kernel libraries do not load (transformers imports it)
logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so: at import")
logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses")
logging.getLogger("user_code").warning("the workload's own warning")

def make():
    logging.getLogger("torchao").warning("Failed to load _C_cutlass_90a.so: at the call")
    logging.getLogger("torchao").error("an error of torchao's")
    return Workload(torch.nn.Linear(3, 1), batches=lambda rank, world_size: iter([]))
"""


def test_the_warnings_of_torchaos_first_import_are_held_back(tmp_path, monkeypatch, caplog):
    """A workload whose import (or call) imports torchao for the first time, as transformers
    does where torchao is installed: torchao's warnings of kernel libraries that do not load
    and torch's pytree notes are held back, in every rank and the launcher; its errors, and
    every other logger's warnings, are not; the loggers' levels are as they were after."""
    monkeypatch.delitem(sys.modules, "torchao", raising=False)  # (not imported yet)
    write(tmp_path, NOISY_IMPORT_PY, "noisy_workload.py")
    plan = load_plan(write(tmp_path, "workload: noisy_workload:make\n"))
    with caplog.at_level("WARNING"):
        load_workload(plan)
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert said == [
        ("user_code", "the workload's own warning"),
        ("torchao", "an error of torchao's"),
    ]
    assert logging.getLogger("torchao").level == logging.NOTSET
