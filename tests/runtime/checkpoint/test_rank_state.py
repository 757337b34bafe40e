"""A rank's state dict (zerocc/runtime/checkpoint/rank_state.py) records the degree of every
mesh dimension that shapes what a rank holds, read from the registered dimensions
(``DIMENSIONS``), and loads only under the same; a checkpoint written before a degree was
recorded loads as it did."""

from __future__ import annotations

import pytest
import torch
from models import EP_MODELS

import zerocc
from zerocc.compiler.parallel.dims import DIMENSIONS
from zerocc.errors import RankMismatchError

MODEL = "one_sided_moe"


def _step(ep: int) -> zerocc.TrainStep:
    build, _, units = EP_MODELS[MODEL]
    torch.manual_seed(0)
    plan = {
        "zero": {"stage": 3},
        "parallel": {"ep": ep},
        "units": units,
        "backend": {"name": "eager", "device": "cpu"},
    }
    return zerocc.compile(build(), plan, comm=zerocc.FakeComm(2))  # (state built, no step)


@pytest.fixture(scope="module")
def saved() -> dict:
    """Rank 0's state under ep 2 of 2 ranks (a fake process group)."""
    return _step(2).state_dict()


def test_every_dimension_that_shapes_a_ranks_state_is_recorded(saved):
    degrees = {d.degree for d in DIMENSIONS if d.shapes_state}
    assert {"replicate", "tp", "pp", "ep"} <= degrees
    assert set(saved["zerocc"]) >= {"world_size", "stage", *degrees}
    assert saved["zerocc"]["ep"] == 2
    assert "secondary" not in saved["zerocc"]  # a copy kept within the step: no state


def test_a_state_saved_under_another_ep_is_refused(saved):
    with pytest.raises(RankMismatchError, match="saved with ep=2, this run has ep=1"):
        _step(1).load_state_dict(saved)


def test_a_state_written_before_the_degrees_were_recorded_still_loads(saved):
    """The manifest's old layout: no ep (and, older, no replicate, tp or pp)."""
    step = _step(2)
    old = {**saved, "zerocc": {k: v for k, v in saved["zerocc"].items() if k != "ep"}}
    old["zerocc"]["steps"] = 5
    step.load_state_dict(old)
    older = {k: v for k, v in old["zerocc"].items() if k not in ("replicate", "tp", "pp")}
    step.load_state_dict({**saved, "zerocc": older})
    assert step.steps == 5
