"""The other optimizers' states in checkpoints: saved on N ranks at stage S, resumed on M ranks
at stage T, the run goes on as one process under the same torch.optim optimizer would (as
tests/parity/test_checkpoint_reshard_parity.py holds AdamW's). Centered RMSprop with momentum
keeps three states and counts its steps: a state loaded into the wrong place, not at all, or a
step count restarted moves the run by orders of magnitude more than the 1e-5 tolerance.
Adagrad's first step fills its sum with initial_accumulator_value: a resumed run must not
again."""

from __future__ import annotations

import pytest
import torch
from models import build, loss_of
from multirank import run_ranks

import zerocc
from parity import OPTIMIZER_CLASSES, batch_of, relative_difference

FIRST, THEN = 2, 2  # steps before the save, and after the resume
CASE = {"model": "gpt"}
RMSPROP = {"name": "rmsprop", "lr": 1e-3, "eps": 1e-3, "momentum": 0.5, "centered": True,
           "weight_decay": 0.01}  # fmt: skip
ADAGRAD = {"name": "adagrad", "lr": 5e-2, "initial_accumulator_value": 0.1, "lr_decay": 0.01}
PAIRS = {  # name -> optimizer, (ranks, stage) saved, (ranks, stage) loaded
    "rmsprop 2xZ3->1xZ0": (RMSPROP, (2, 3), (1, 0)),
    "adagrad 2xZ2->3xZ1": (ADAGRAD, (2, 2), (3, 1)),
}
SLOW = {"adagrad 2xZ2->3xZ1"}


def _plan(stage: int, optimizer: dict) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": optimizer,
        "backend": {"name": "eager", "device": "cpu", "kernels": "torch"},
        "seed": 7,
    }


def _first(rank: int, world: int, folder: str, stage: int, optimizer: dict) -> list[float]:
    step = zerocc.compile(build("gpt"), _plan(stage, optimizer))
    losses = [float(step(*batch_of(CASE, i, step.data_rank))) for i in range(FIRST)]
    step.save(folder)
    return losses


def _then(rank: int, world: int, folder: str, stage: int, optimizer: dict) -> dict:
    step = zerocc.compile(build("gpt", seed=123), _plan(stage, optimizer))  # other weights
    step.load(folder)
    losses = [float(step(*batch_of(CASE, i, step.data_rank))) for i in range(FIRST, FIRST + THEN)]
    return {"losses": losses, "params": step.full_state_dict()}


def _reference(optimizer: dict, first_world: int, then_world: int):
    model = build("gpt")
    fields = {k: v for k, v in optimizer.items() if k != "name"}
    opt = OPTIMIZER_CLASSES[optimizer["name"]](model.parameters(), **fields)
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
    return losses, model.state_dict()


@pytest.mark.parametrize(
    "pair", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in PAIRS]
)
def test_resume_under_another_world_size_and_stage_matches_one_process(tmp_path, pair):
    optimizer, (n, s), (m, t) = PAIRS[pair]
    folder = str(tmp_path / "ckpt")
    first = run_ranks(n, _first, folder, s, optimizer, timeout=300)
    then = run_ranks(m, _then, folder, t, optimizer, timeout=300)
    ref_losses, ref_state = _reference(optimizer, n, m)
    for rank in range(n):
        ref = [ref_losses[i, rank] for i in range(FIRST)]
        assert first[rank] == pytest.approx(ref, rel=1e-5), rank
    for rank in range(m):
        ref = [ref_losses[i, rank] for i in range(FIRST, FIRST + THEN)]
        assert then[rank]["losses"] == pytest.approx(ref, rel=1e-5), rank
    params = then[0]["params"]
    for name, ref in ref_state.items():
        assert relative_difference(params[name], ref) <= 1e-5, name
