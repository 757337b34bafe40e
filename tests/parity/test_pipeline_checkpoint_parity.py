"""A pipeline's checkpoints by model name (issue 47): saved under ``pp 2 × dp 2``, resumed with
no pipeline (``pp 1``); saved under ``pp 2``, resumed under ``pp 4``; saved under ``pp 2 × tp
2``, resumed by one process; saved under ``pp 2 × ep 2`` (a mixture of experts), resumed with
neither; saved with no pipeline, resumed under ``pp 2 × dp 2``: each run
goes on as one process trained on the same batches would.

The oracle is tests/parity's: one process, torch.optim.AdamW, every data rank's micro-batches
of each step. Each pair keeps the number of data-parallel ranks (the batches a step trains on)
and changes the pipeline, the ZeRO stage and the world size. Tolerance 1e-5 relative (losses and
every parameter), as test_pipeline_parity.py says why; a shard loaded into another stage's
place, a tied embedding saved twice or not at all, or a counter not restored, moves the run by
orders of magnitude more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multirank import run_ranks
from optional_deps import HF_MODELS

import zerocc
from parity import _model, batch_of, plan_of, reference
from zerocc.runtime.checkpoint import Manifest, resolve

FIRST, THEN = 2, 2  # steps before the save, and after the resume
TOL = 1e-5
GPT = {"model": "gpt4", "accum": 4, "steps": FIRST + THEN, "backend": "eager"}
PAIRS = {  # saved -> resumed: the same data-parallel ranks, another pipeline
    "pp2xdp2 Z3->dp2 Z1": ({"stage": 3, "world": 4, "pp": 2}, {"stage": 1, "world": 2}),
    "pp2 Z2->pp4 Z3": ({"stage": 2, "world": 2, "pp": 2}, {"stage": 3, "world": 4, "pp": 4}),
    # each tp rank of each stage saves its rows of the split layers; one process reads them all
    "pp2xtp2 Z3->1xZ0": ({"stage": 3, "world": 4, "pp": 2, "tp": 2}, {"stage": 0, "world": 1}),
    # each stage's experts split over its 2 data ranks (ep 2): their rows read back whole
    "pp2xep2 Z3->dp2 Z2": (
        {"model": "mixtral_grouped", "stage": 3, "world": 4, "pp": 2, "ep": 2},
        {"model": "mixtral_grouped", "stage": 2, "world": 2},
    ),
    "dp2 Z3->pp2xdp2 Z1": (
        {"stage": 3, "world": 2},
        {"stage": 1, "world": 4, "pp": 2, "schedule": "zero-bubble"},
    ),
}
# (--slow: the same loads by name, into another pipeline, and into one from none)
SLOW = {"pp2 Z2->pp4 Z3", "dp2 Z3->pp2xdp2 Z1"}


def _steps(step, case: dict[str, Any], steps: range) -> list[float]:
    """Train ``steps`` of the case: a pipeline takes a step's micro-batches as one batch (it
    cuts them back), a TrainStep one call each, accumulating."""
    k, losses = case["accum"], []
    for s in steps:
        micro = [batch_of(case, s * k + m, step.data_rank) for m in range(k)]
        if "pp" in case:
            losses.append(float(step(*(torch.cat(parts) for parts in zip(*micro, strict=True)))))
        else:
            losses.append(sum(float(step(*batch)) for batch in micro) / k)
    return losses


def _first(rank: int, world: int, folder: str, case: dict[str, Any]) -> dict[str, Any]:
    step = zerocc.compile(_model(case), plan_of(case))
    losses = _steps(step, case, range(FIRST))
    step.save(folder)
    return {"losses": losses, "data_rank": step.data_rank}


def _then(rank: int, world: int, folder: str, case: dict[str, Any]) -> dict[str, Any]:
    # other weights (seeded by rank + 1): all of them must come from the checkpoint
    step = zerocc.compile(_model({**case, "rank_seeds": True}, rank + 1), plan_of(case))
    notes = step.load(folder)  # (a pipeline: before its first call, which cuts the stages)
    resumed = step.steps
    losses = _steps(step, case, range(FIRST, FIRST + THEN))
    return {
        "losses": losses,
        "data_rank": step.data_rank,
        "notes": notes,
        "resumed_at": resumed,
        "steps": step.steps,
        "params": step.full_state_dict(),
    }


@pytest.mark.parametrize(
    "pair", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in PAIRS]
)
def test_a_pipeline_checkpoint_resumes_under_another_pipeline(tmp_path, pair):
    saved, resumed = ({**GPT, **half} for half in PAIRS[pair])
    if saved["model"] in HF_MODELS:
        pytest.importorskip("transformers")
    folder = str(tmp_path / "ckpt")
    first = run_ranks(saved["world"], _first, folder, saved, timeout=300)
    then = run_ranks(resumed["world"], _then, folder, resumed, timeout=300)
    ref_losses, ref_state = reference(saved)  # (both halves train on these batches)
    k = GPT["accum"]

    def expected(data_rank: int, steps: range) -> list[float]:
        mine = ref_losses[data_rank]
        return [sum(mine[s * k : (s + 1) * k]) / k for s in steps]

    for got in first:
        assert got["losses"] == pytest.approx(expected(got["data_rank"], range(FIRST)), rel=TOL)
    held: dict[str, torch.Tensor] = {}
    for got in then:
        later = expected(got["data_rank"], range(FIRST, FIRST + THEN))
        assert got["losses"] == pytest.approx(later, rel=TOL)
        assert (got["resumed_at"], got["steps"]) == (FIRST, FIRST + THEN)
        held |= got["params"]
    names = dict(_model(saved).named_parameters(remove_duplicate=False))
    assert held.keys() == {n for n in ref_state if n in names}
    for name, value in held.items():
        torch.testing.assert_close(value, ref_state[name], rtol=TOL, atol=1e-6, msg=name)
    pp = saved.get("pp", 1), resumed.get("pp", 1)
    assert f"saved under parallel.pp: {pp[0]}, resharded for {pp[1]}" in then[0]["notes"]
    # Every element of every tensor saved once: a tied embedding by one pipeline rank, the
    # buffers by the first rank that reads them.
    manifest = Manifest.read(resolve(folder))
    for name, entry in manifest.tensors.items():
        if name.startswith("model/"):
            numel = torch.Size(entry.shape).numel()
            assert sum(c.numel for c in entry.chunks) == numel, name
