"""A pipeline step's state means what any step's does (issue 78): ``full_state_dict()`` and
``materialize_model()`` give the whole model on every rank. A user who saves rank 0's
``full_state_dict()`` under ``parallel.pp: 2`` got only rank 0's stages (half a model), silently.

4 gloo ranks train the 4-layer GPT as pp 2 × dp 2 (2 micro-batches), then as 4 data-parallel
ranks on the same micro-batches (rank ``2d + m`` takes data rank ``d``'s micro-batch ``m``: the
same mean loss over the same samples, the same update); rank 0's state of the first is the
second's, every key in the model's order, to test_parity.py's tolerance (1e-5 relative: the
same sums in another association), and so is every other rank's.
"""

from __future__ import annotations

from typing import Any

import torch
from multirank import run_ranks

import zerocc
from parity import _model, batch_of, plan_of

TOL = 1e-5
PIPELINE = {"model": "gpt4", "stage": 3, "world": 4, "pp": 2, "accum": 2, "steps": 2}
DATA_PARALLEL = {"model": "gpt4", "stage": 3, "world": 4, "steps": 2}


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers(remove_duplicate=False)}


def _both(rank: int, world: int) -> dict[str, Any]:
    """The pipeline's and the data-parallel run's state on this rank, after the same steps."""
    out: dict[str, Any] = {}
    k = PIPELINE["accum"]
    step = zerocc.compile(_model(PIPELINE, rank), plan_of(PIPELINE))
    for s in range(PIPELINE["steps"]):
        micro = [batch_of(PIPELINE, s * k + m, step.data_rank) for m in range(k)]
        step(*(torch.cat(parts) for parts in zip(*micro, strict=True)))
    out["pipeline"] = step.full_state_dict()
    out["pipeline_buffers"] = _buffers(step.materialize_model())
    data_rank, m = divmod(rank, k)  # (the pipeline's data rank and micro-batch it takes)
    step = zerocc.compile(_model(DATA_PARALLEL, rank), plan_of(DATA_PARALLEL))
    for s in range(DATA_PARALLEL["steps"]):
        step(*batch_of(PIPELINE, s * k + m, data_rank))
    out["data_parallel"] = step.full_state_dict()
    out["data_parallel_buffers"] = _buffers(step.materialize_model())
    return out


def test_every_pipeline_rank_holds_the_whole_model():
    """Rank 0's ``full_state_dict()`` of the pp 2 × dp 2 run is the data-parallel run's: every
    key of the model's ``state_dict()``, in its order, each value to the parity tolerance; every
    rank's is rank 0's, and ``materialize_model()`` gives the model with it and its buffers."""
    ranks = run_ranks(4, _both, timeout=300)
    expected = ranks[0]["data_parallel"]
    assert list(expected) == list(_model(PIPELINE).state_dict())
    for rank, got in enumerate(ranks):
        assert list(got["pipeline"]) == list(expected), f"rank {rank}"
        for name, value in got["pipeline"].items():
            torch.testing.assert_close(value, expected[name], rtol=TOL, atol=1e-6,
                                       msg=f"rank {rank}: {name}")  # fmt: skip
        assert got["pipeline_buffers"].keys() == got["data_parallel_buffers"].keys()
        for name, value in got["pipeline_buffers"].items():
            torch.testing.assert_close(value, got["data_parallel_buffers"][name], msg=name)
