"""Expert parallelism (``parallel.ep``, issue 48) on 4 gloo ranks against one process: each
experts module's experts split over the ep ranks, every call's tokens exchanged by all-to-all,
the experts' units sharded over the ranks holding the same experts.

fp32 to 1e-5 relative, the tolerance of the other fp32 parity tests: the ranks sum gradients in
another order than one process (ulps per step), and each token's expert results are summed in
expert order where ``grouped_mm`` sums them in top-k order (ulps again). An expert's weights
moved to the wrong rank, a token sent to the wrong expert, or a gradient reduced over the wrong
ranks moves the run by orders of magnitude more. bf16 to 1e-2 against the same recipe, as
test_mixed_precision_parity justifies.

Checkpoints: saved under ep 2, resumed under ep 4 and without expert parallelism (every rank
all the experts), each against one process trained on the same batches.

Cases marked ``slow`` (run with ``pytest --slow``) are covered by the others of the default run
(each schedule, stage and offload kind is trained by another case).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip(
    "transformers", reason='mixture-of-experts models need transformers: pip install "zerocc[hf]"'
)

import torch  # noqa: E402
from models import build, entry, loss_of  # noqa: E402
from multirank import run_ranks  # noqa: E402

import zerocc  # noqa: E402
from parity import (  # noqa: E402
    assert_matches_reference,
    batch_of,
    case_id,
    data_ranks,
    is_slow,
    of_speed,
    relative_difference,
    run_once,
    sweep,
    train,
)
from zerocc.errors import NonFiniteError  # noqa: E402

TOL = 1e-5
BF16_TOL = 1e-2
CLIPPED = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01, "grad_clip": 0.05}
CASES = [
    # ep 2 × dp 2: each expert's units sharded over the 2 ranks holding it
    {"model": "mixtral", "stage": 3, "world": 4, "ep": 2},
    # ep 4: every rank its own expert, unsharded
    {"model": "mixtral", "stage": 3, "world": 4, "ep": 4},
    {"model": "mixtral_grouped", "stage": 1, "world": 4, "ep": 2, "slow": True},
    # the clip's norm counts each expert once; gradients accumulated over micro-batches
    {"model": "mixtral_grouped", "stage": 2, "world": 4, "ep": 2, "accum": 2,
     "optimizer": CLIPPED},
    {"model": "qwen_moe", "stage": 2, "world": 4, "ep": 4},  # a shared expert beside them
    {"model": "deepseek", "stage": 3, "world": 4, "ep": 2},  # 8 experts, group routing
    # dense layers split over tp 2, experts over ep 2 within each tp slice's ranks
    {"model": "mixtral_grouped", "stage": 3, "world": 4, "ep": 2, "tp": 2,
     "optimizer": CLIPPED},
    # ... and sequence parallelism: each tp rank's chunk of the tokens exchanged over its ep
    # group, the experts' gradients summed over tp (no router loss: a statistic of a chunk)
    {"model": "mixtral_no_router_loss", "stage": 1, "world": 4, "ep": 2, "tp": 2, "sp": True,
     "accum": 2},
    # stage 0: each rank holds its experts whole, all-reduced over edp; the clip's norm sums
    # the experts' part over ep (every other expert is on another ep rank)
    {"model": "mixtral_grouped", "stage": 0, "world": 4, "ep": 2, "optimizer": CLIPPED,
     "slow": True},
    {"model": "mixtral", "stage": 0, "world": 4, "ep": 2, "tp": 2, "accum": 2,
     "optimizer": CLIPPED},
    # hybrid sharding: dense units sharded in 2 shard groups and all-reduced across the 2
    # replicas, the experts' units sharded over their edp ranks alone (no replica of them);
    # the clip's norm and the overflow flags summed across the replicas for the experts
    {"model": "mixtral", "stage": 2, "world": 4, "ep": 2, "replicate": 2, "accum": 2,
     "optimizer": CLIPPED},
    # recomputed layers: the exchanges and the experts' ops are not recomputed (what they
    # received is kept by the runtime until the experts' backward), the rest of the layer is
    {"model": "mixtral", "stage": 3, "world": 4, "ep": 2, "recompute": {"units": "all"}},
    # every token to experts 0-1: ep rank 1 (and 3) receives none at any step
    {"model": "one_sided_moe", "stage": 3, "world": 4, "ep": 2},
    # ... with its experts' input needing no gradient (the experts fine-tuned alone)
    {"model": "one_sided_experts_only", "stage": 2, "world": 4, "ep": 2},
]  # fmt: skip
BF16 = [{"model": "mixtral", "stage": 3, "world": 4, "ep": 2, "precision": {"param": "bf16"}}]


@run_once
def _results(slow: bool = False) -> dict:
    return run_ranks(4, train, of_speed(CASES, slow) + ([] if slow else BF16), timeout=600)


@pytest.mark.parametrize("case", sweep(CASES), ids=case_id)
def test_matches_unsharded_training(case):
    results = _results(is_slow(case))
    assert_matches_reference(results, case, TOL)
    elements = results[0][case_id(case)]["elements"]
    assert elements.get("all_to_all (ep)", 0) > 0, elements  # tokens were exchanged
    # the experts' units are gathered or reduced over the ranks holding the same experts; where
    # each expert is on one rank (ep = data ranks), there is nothing to gather or reduce
    on_edp = any(kind.endswith("(edp)") for kind in elements)
    assert on_edp == (case["ep"] < data_ranks(case)), elements


@pytest.mark.parametrize("case", BF16, ids=case_id)
def test_bf16_matches_the_cast_recipe(case):
    assert_matches_reference(_results(), case, BF16_TOL)


# -- checkpoints across ep -----------------------------------------------------------------------

MODEL, FIRST, THEN = "mixtral_grouped", 2, 2
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}


def _plan(ep: int, stage: int = 3) -> dict:
    return {
        "zero": {"stage": stage},
        "parallel": {"ep": ep},
        "units": entry(MODEL)[2],
        "optimizer": OPTIMIZER,
        "backend": {"name": "eager", "device": "cpu"},
        "seed": 7,
    }


def _first(rank: int, world: int, folder: str, ep: int, stage: int) -> dict:
    step = zerocc.compile(build(MODEL), _plan(ep, stage))
    losses = [float(step(*batch_of({"model": MODEL}, i, step.data_rank))) for i in range(FIRST)]
    step.save(folder)
    return {"losses": losses}


def _then(rank: int, world: int, folder: str, ep: int) -> dict:
    step = zerocc.compile(build(MODEL, seed=123), _plan(ep))  # other weights, then loaded
    notes = step.load(folder)
    steps = range(FIRST, FIRST + THEN)
    losses = [float(step(*batch_of({"model": MODEL}, i, step.data_rank))) for i in steps]
    return {"losses": losses, "notes": notes, "params": step.full_state_dict()}


def _reference(world: int):
    model = build(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.01)
    torch.set_num_threads(1)  # as the ranks
    losses = {}
    for s in range(FIRST + THEN):
        opt.zero_grad()
        for r in range(world):
            loss = loss_of(model(*batch_of({"model": MODEL}, s, r)))
            losses[s, r] = float(loss.detach())
            (loss / world).backward()
        opt.step()
    return losses, model.state_dict()


@pytest.mark.parametrize(
    ("saved_stage", "then_ep"),
    # ep 1 with --slow: its load (rows of whole tensors into whole tensors) is the tp -> no tp
    # reshard's of test_checkpoint_reshard_parity.py; at stage 0 each ep rank's experts are
    # whole on both its edp ranks, saved once
    [(3, 4), pytest.param(3, 1, marks=pytest.mark.slow), (0, 4)],
    ids=["ep2->ep4", "ep2->ep1", "ep2 stage 0->ep4"],
)
def test_a_checkpoint_saved_under_one_ep_resumes_under_another(tmp_path, saved_stage, then_ep):
    folder = str(tmp_path / "ckpt")
    first = run_ranks(4, _first, folder, 2, saved_stage, timeout=300)
    then = run_ranks(4, _then, folder, then_ep, timeout=300)
    ref_losses, ref_state = _reference(4)
    for rank in range(4):
        assert first[rank]["losses"] == pytest.approx(
            [ref_losses[i, rank] for i in range(FIRST)], rel=TOL
        )
        assert then[rank]["losses"] == pytest.approx(
            [ref_losses[i, rank] for i in range(FIRST, FIRST + THEN)], rel=TOL
        )
    params = then[0]["params"]
    assert set(params) == set(ref_state)
    for name, ref in ref_state.items():
        assert relative_difference(params[name], ref) <= TOL, name
    assert f"saved under parallel.ep: 2, resharded for {then_ep}" in then[0]["notes"]


# -- a router that emits NaN ---------------------------------------------------------------------


class _PoisonedRouter(torch.nn.Module):
    """Mixtral whose first router reads its input plus ``poison`` (a batch tensor: 0, or NaN
    on one rank at one step), so that its logits, routing weights and every gradient after
    them are NaN there."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = build(MODEL)
        gate = self.moe.lm.model.layers[0].mlp.gate
        poison: list[torch.Tensor] = []  # the call's, read by the router (no module cycle)
        plain = gate.forward
        gate.forward = lambda hidden: plain(hidden + poison[-1])
        self._poison = poison

    def forward(self, ids: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        self._poison[:] = [poison]
        return self.moe(ids)


def _poisoned(rank: int, world: int, stage: int) -> dict:
    step = zerocc.compile(_PoisonedRouter(), _plan(2, stage) | {"units": entry(MODEL)[2]})
    errors, losses = [], []
    for s in range(3):
        bad = s == 1 and rank == 1
        poison = torch.full((1,), float("nan") if bad else 0.0)
        try:
            losses.append(float(step(*batch_of({"model": MODEL}, s, rank), poison)))
        except NonFiniteError as e:
            errors.append(str(e))
    return {"errors": errors, "losses": losses}


@pytest.mark.parametrize("stage", [3, 0])
def test_a_router_that_emits_nan_stops_every_rank_naming_the_step(stage):
    """The NaN reaches other ranks' experts through the all-to-all and every gradient through
    the reductions: the non-finite guard names it on both ranks, which go on afterwards (at
    stage 0 the experts' flags agreed over ep: no reduction sums them)."""
    for rank, record in enumerate(run_ranks(2, _poisoned, stage, timeout=300)):
        (message,) = record["errors"]
        assert f"rank {rank}, step 2:" in message and "unit" in message, message
        assert len(record["losses"]) == 2 and all(map(math.isfinite, record["losses"]))
