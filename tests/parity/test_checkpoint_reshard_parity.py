"""Checkpoints by model name: saved on N ranks at stage S, resumed on M ranks at stage T, the
run goes on as one process trained on the same batches would.

The oracle trains the model with torch.optim.AdamW on every rank's batches of each step: the
first steps on the N ranks' batches, the rest on the M ranks'. Tolerance 1e-5 relative (losses
and every parameter), as the other fp32 parity tests: the ranks sum gradients in another order
than one process (a few ulps per step); a weight or moment loaded into the wrong place, or not
at all, moves the run by orders of magnitude more.

The pairs train under the run's backend (``pytest --backend inductor`` compiles them; 1e-5 is
also the compiled fp32 tolerance, tests/parity/__init__.py), and one pair saves under the eager
backend and resumes under Inductor in every run.
"""

from __future__ import annotations

import pytest
import torch
from models import GPT_TP_LAYERS, build, loss_of
from multirank import run_ranks

import zerocc
from parity import backend_of, batch_of, relative_difference, torch_scheduler
from zerocc.runtime.checkpoint.export import export_model

FIRST, THEN = 2, 2  # steps before the save, and after the resume
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}
CASE = {"model": "gpt"}
SCHEDULED = {**OPTIMIZER, "schedule": {"name": "cosine", "warmup_steps": 2, "total_steps": 4}}


def _backend(name: str) -> dict:
    return {"name": name, "device": "cpu", "kernels": "torch"}


def _plan(stage: int, **extra) -> dict:
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": OPTIMIZER,
        "backend": _backend(backend_of(CASE)),
        "seed": 7,
    }
    return plan | extra


def _first(rank: int, world: int, folder: str, stage: int, extra: dict) -> dict:
    step = zerocc.compile(build("gpt"), _plan(stage, **extra))
    losses = [float(step(*batch_of(CASE, i, step.data_rank))) for i in range(FIRST)]
    step.save(folder)
    return {"losses": losses, "params": step.full_state_dict()}


def _then(rank: int, world: int, folder: str, stage: int, extra: dict) -> dict:
    step = zerocc.compile(build("gpt", seed=123), _plan(stage, **extra))  # other weights
    notes = step.load(folder)
    steps = range(FIRST, FIRST + THEN)
    losses = [float(step(*batch_of(CASE, i, step.data_rank))) for i in steps]
    params, ran = step.full_state_dict(), step.record().backend_notes
    return {"losses": losses, "notes": notes, "params": params, "steps": step.steps, "ran": ran}


def _reference(first_world: int, then_world: int, schedule: dict | None):
    model = build("gpt")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=OPTIMIZER["lr"], eps=OPTIMIZER["eps"], weight_decay=OPTIMIZER["weight_decay"]
    )
    scheduler = torch_scheduler(schedule, opt) if schedule else None
    losses: dict[tuple[int, int], float] = {}  # (step, rank) -> loss
    torch.set_num_threads(1)  # as the ranks
    for s in range(FIRST + THEN):
        world = first_world if s < FIRST else then_world
        opt.zero_grad()
        for r in range(world):
            loss = loss_of(model(*batch_of(CASE, s, r)))
            losses[s, r] = float(loss.detach())
            (loss / world).backward()
        opt.step()
        if scheduler:
            scheduler.step()
    return losses, model.state_dict()


TP2 = {"tp": 2, "tp_layers": GPT_TP_LAYERS}
RESHARDS = {  # (ranks, stage) saved -> (ranks, stage) loaded, extra plan of each
    "2xZ3->3xZ1": ((2, 3), (3, 1), {}, {}),
    "3xZ2->2xZ3": ((3, 2), (2, 3), {}, {}),
    "2xZ3->1xZ0": ((2, 3), (1, 0), {}, {}),
    "2xZ3 offload->2xZ2": ((2, 3), (2, 2), {"offload": {"optimizer": "cpu"}}, {}),
    # The schedule goes on where it was: at step 3 the peak rate, where a restart would be at 0.
    "2xZ3 cosine->3xZ1": ((2, 3), (3, 1), {"optimizer": SCHEDULED}, {"optimizer": SCHEDULED}),
    # Saved by the eager backend, resumed by the whole program compiled by Inductor: the same
    # files, whatever ran the step (the state lives in the runtime's buffers either way).
    "2xZ3 eager->3xZ1 inductor": (
        (2, 3),
        (3, 1),
        {"backend": _backend("eager")},
        {"backend": _backend("inductor-whole")},
    ),
    # Hybrid sharding: the first replica's ranks save the shards; every replica loads them.
    "4xZ3 2 replicas->2xZ3": ((4, 3), (2, 3), {"zero": {"stage": 3, "replicate": 2}}, {}),
    "2xZ2->4xZ2 2 replicas": ((2, 2), (4, 2), {}, {"zero": {"stage": 2, "replicate": 2}}),
    # Tensor parallelism: each tp rank saves its rows of the split weights (strided runs of the
    # whole tensors), and a run with another split, or none, reads the rows it holds.
    "2x2 tp Z3->3xZ1": ((4, 3), (3, 1), {"parallel": TP2}, {}),
    "2xZ2->2x2 tp Z3": ((2, 2), (4, 3), {}, {"parallel": TP2}),
}
# Run only with --slow: the same load path as the others, on other counts and stages.
SLOW = {"3xZ2->2xZ3", "2xZ3->1xZ0", "2xZ2->4xZ2 2 replicas"}


@pytest.mark.parametrize(
    "pair", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in RESHARDS]
)
def test_resume_under_another_world_size_and_stage_matches_one_process(tmp_path, pair):
    (n, s), (m, t), first_extra, then_extra = RESHARDS[pair]
    folder = str(tmp_path / "ckpt")
    first = run_ranks(n, _first, folder, s, first_extra, timeout=300)
    then = run_ranks(m, _then, folder, t, then_extra, timeout=300)
    schedule = first_extra.get("optimizer", {}).get("schedule")
    tp_first, tp_then = (x.get("parallel", {}).get("tp", 1) for x in (first_extra, then_extra))
    ref_losses, ref_state = _reference(n // tp_first, m // tp_then, schedule)
    for rank in range(n):
        ref = [ref_losses[i, rank // tp_first] for i in range(FIRST)]
        assert first[rank]["losses"] == pytest.approx(ref, rel=1e-5), rank
    for rank in range(m):
        ref = [ref_losses[i, rank // tp_then] for i in range(FIRST, FIRST + THEN)]
        assert then[rank]["losses"] == pytest.approx(ref, rel=1e-5), rank
        assert then[rank]["steps"] == FIRST + THEN
    params = then[0]["params"]
    assert set(params) == set(ref_state)
    for name, ref in ref_state.items():
        assert relative_difference(params[name], ref) <= 1e-5, name
    if n != m:
        assert any("saved on" in note for note in then[0]["notes"])
    if then_extra.get("backend", {}).get("name") == "inductor-whole":  # compiled, not run eagerly
        assert then[0]["ran"][0].startswith("inductor: the whole program compiled"), then[0]["ran"]
    # the export reads every tensor whole, from whatever runs the ranks saved it in
    exported = torch.load(export_model(folder, tmp_path / "model.pt", "torch"))
    assert exported.keys() == first[0]["params"].keys()
    for name, value in first[0]["params"].items():
        assert torch.equal(exported[name], value), name
