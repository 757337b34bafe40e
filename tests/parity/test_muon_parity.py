"""Parity: Muon with AdamW groups, each matrix orthogonalized once by its owner, on 2 gloo ranks
(ZeRO 3, 2, 1 and 0) and on one, against torch.optim.Muon (the hidden 2-D matrices) and
torch.optim.AdamW (the embeddings, norms and biases) in one process on all ranks' batches.

fp32, the repository's 1e-5: the ranks' reduced gradients differ from one process's by fp32
rounding; Muon's Newton-Schulz runs in bf16 as torch's does, and a gradient one ulp off rounds
to the same bf16 matrix nearly always (where it does not, one element moves by a bf16 ulp of a
step: ~1e-3 of lr, far below 1e-5 of a weight matrix's norm).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from multirank import run_ranks

from parity import (
    _backward_step,
    _model,
    assert_trained_alike,
    case_id,
    data_ranks,
    reference,
    train,
)
from zerocc.compiler.names import glob_matches

TOL = 1e-5
MUON = {"name": "muon", "lr": 0.02, "weight_decay": 0.1}
# an AdamW group of its own rate and betas: the embeddings (the head is tied to wte)
GROUPS = [{"params": ["transformer.w[tp]e.weight"], "name": "adamw", "lr": 5e-3,
           "betas": [0.9, 0.99], "eps": 1e-3}]  # fmt: skip
# every AdamW parameter (vectors, embeddings) at eps 1e-3, as tests/parity/test_parity.py's
# AdamW: a noise-level gradient's rounding (accumulation sums in another order) is not amplified
VECTORS = [{"params": ["**.bias", "**.ln_*.weight", "transformer.ln_f.weight",
                       "transformer.w[tp]e.weight"], "name": "adamw", "eps": 1e-3}]  # fmt: skip
CASES = [
    {"model": "gpt", "stage": 3, "world": 2, "optimizer": {**MUON, "groups": GROUPS}},
    {"model": "gpt", "stage": 2, "world": 2, "optimizer": {**MUON, "eps": 1e-6}, "steps": 3},
    {
        "model": "gpt",
        "stage": 1,
        "world": 2,
        "accum": 2,
        "optimizer": {
            **MUON,
            "grad_clip": 0.05,
            "nesterov": False,
            "adjust_lr_fn": "match_rms_adamw",
            "groups": VECTORS,
        },  # fmt: skip
        "steps": 3,
    },
    {"model": "gpt", "stage": 0, "world": 2, "optimizer": MUON, "steps": 3},
]
ONE_RANK = [
    {"model": "gpt", "stage": 3, "world": 1, "optimizer": {**MUON, "groups": GROUPS}},
    {"model": "gpt", "stage": 2, "world": 1, "accum": 2, "optimizer": MUON, "steps": 3},
]


def _muon_reference(case: dict[str, Any]):
    """One process: torch.optim.Muon on the hidden 2-D matrices, torch.optim.AdamW on the rest
    (in the case's AdamW groups, with their values, where one names them)."""
    model = _model(case)
    cfg = {"momentum": 0.95, "nesterov": True, "eps": 1e-7, **case["optimizer"]}
    embeddings = ("transformer.wte.weight", "transformer.wpe.weight")
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if p.dim() == 2 and n not in embeddings]
    muon = torch.optim.Muon(
        matrices, lr=cfg["lr"], weight_decay=cfg["weight_decay"], momentum=cfg["momentum"],
        nesterov=cfg["nesterov"], eps=cfg["eps"], adjust_lr_fn=cfg.get("adjust_lr_fn"),
    )  # fmt: skip
    groups: dict[int, list[torch.nn.Parameter]] = {}
    for name, p in named.items():
        if p.dim() != 2 or name in embeddings:
            first = next((i for i, g in enumerate(cfg.get("groups", []))
                          if any(glob_matches(name, x) for x in g["params"])), -1)  # fmt: skip
            groups.setdefault(first, []).append(p)
    adamw = torch.optim.AdamW(
        [{"params": ps, **_adamw_values(cfg["groups"][i] if i >= 0 else {})}
         for i, ps in groups.items()],
        lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg["weight_decay"],
    )  # fmt: skip
    params = list(named.values())
    losses: list[list[float]] = [[] for _ in range(data_ranks(case))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (see parity.reference)
    try:
        for s in range(case.get("steps", 5)):
            muon.zero_grad()
            adamw.zero_grad()
            _backward_step(case, model, s, losses)
            if cfg.get("grad_clip"):
                torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
            muon.step()
            adamw.step()
    finally:
        torch.set_num_threads(threads)
    return losses, model.state_dict()


def _adamw_values(group: dict[str, Any]) -> dict[str, Any]:
    """An AdamW group's own values, as torch.optim's param group takes them."""
    out = {k: group[k] for k in ("lr", "eps", "weight_decay") if k in group}
    return out | ({"betas": tuple(group["betas"])} if "betas" in group else {})


@functools.cache
def _results(world: int) -> list[dict]:
    return run_ranks(world, train, CASES if world == 2 else ONE_RANK)


@pytest.mark.parametrize("case", CASES + ONE_RANK, ids=case_id)
def test_muon_matches_torch(case):
    ranks = _results(case["world"])
    losses, state = _muon_reference(case)
    assert_trained_alike(ranks, case, losses, state, TOL)


def test_the_update_moves_what_muon_moves():
    """A plain AdamW reference (no Muon) is far from the run: the tolerance above tells
    Muon's update from AdamW's."""
    case = CASES[0]
    ranks = _results(2)
    adamw = {**case, "optimizer": {"name": "adamw", "lr": 0.02, "eps": 1e-8, "weight_decay": 0.1}}
    _, state = reference(adamw)
    with pytest.raises(AssertionError):
        assert_trained_alike(ranks, case, _muon_reference(case)[0], state, TOL)
