"""One step runner for every plan (issue 78): a pipeline's step is a TrainStep whose runner
calls the pipeline's walk (zerocc/runtime/pipeline_rank.py) where a data-parallel step runs one
program per micro-batch; what a user sees of a step (its errors and agreements included) is the
runner's, the same under a pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from multirank import run_ranks
from staging import gpt

import zerocc
from zerocc.errors import NonFiniteError, RankMismatchError

ROOT = Path(zerocc.__file__).parent
PIPELINE = {"parallel": {"pp": 2}, "pipeline": {"microbatches": 2},
            "units": {"classes": ["Block"]}, "backend": {"device": "cpu"}}  # fmt: skip


@pytest.mark.parametrize("pp", [1, 2])
def test_every_plan_compiles_to_the_one_step_type(pp):
    plan = PIPELINE if pp > 1 else {"units": {"classes": ["Block"]}, "backend": {"device": "cpu"}}
    step = zerocc.compile(gpt(4), plan, comm=zerocc.FakeComm(world_size=2))
    assert type(step) is zerocc.TrainStep
    assert (step.pipeline is not None) == (pp > 1)
    assert "PipelineStep" not in zerocc.__all__ and not hasattr(zerocc, "PipelineStep")


def _step_classes() -> list[str]:
    """Every class of zerocc/ that defines a step's call: ``__call__`` beside ``end_of_data``."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if {"__call__", "end_of_data"} <= methods:
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.name}")
    return found


def test_one_runner_runs_every_step():
    """No second step runner: the pipeline's runtime is a strategy of the one runner, not a
    class of its own beside it (zerocc/pipeline_step.py's PipelineStep was one)."""
    assert not (ROOT / "pipeline_step.py").exists()
    assert _step_classes() == ["zerocc/runtime/step.py:StepRunner"]


class _PoisonedBias(torch.nn.Module):
    """The loss reads the batch's ``gain`` only through the last element of ``second.bias``
    (tests/runtime/test_nonfinite.py's model): as a pipeline of 2 stages, on rank 1's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        out = self.second(torch.tanh(self.first(x)))  # (B, 3)
        return torch.nn.functional.mse_loss(out, y) + gain * self.second.bias[-1]


def _batch(step: int, gain: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g), torch.tensor(gain)


def _nonfinite_then_ahead(rank: int, world: int) -> dict[str, str]:
    """Step 1 trains, step 2's gradient is inf (``on_nonfinite: error``); then rank 0 trains
    on while rank 1 asks for the model."""
    plan = {"parallel": {"pp": 2}, "pipeline": {"microbatches": 2},
            "units": {"modules": ["first", "second"]}, "optimizer": {"eps": 1e-3},
            "precision": {"on_nonfinite": "error"}, "backend": {"device": "cpu"}}  # fmt: skip
    step = zerocc.compile(_PoisonedBias(), plan)
    step(*_batch(0, 0.0))
    out = {}
    try:
        step(*_batch(1, float("inf")))
    except NonFiniteError as exc:
        out["nonfinite"] = str(exc)
    try:
        if rank == 0:
            step(*_batch(2, 0.0))
        else:
            step.materialize_model()
    except RankMismatchError as exc:
        out["ahead"] = str(exc)
    return out


def test_a_pipelines_errors_name_the_unit_and_the_call_as_a_data_parallel_steps_do():
    """A non-finite step names the unit whose gradient was not finite on every rank, not
    '?' on the ranks that do not hold it (each rank's flags are its stages'); a rank asking
    for materialize_model() while its peer trains is told so under that name, not as
    full_state_dict()."""
    for rank, got in enumerate(run_ranks(2, _nonfinite_then_ahead, timeout=120)):
        assert f"rank {rank}, step 2: the reduced gradient of unit 'second'" in got["nonfinite"]
        assert "'?'" not in got["nonfinite"] and "'first'" not in got["nonfinite"], got
        assert "rank 1: materialize_model() after micro-batch 1" in got["ahead"], got
        assert "full_state_dict()" not in got["ahead"], got
