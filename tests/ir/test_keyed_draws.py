"""Keyed draws (``capture.draws: keyed``, :mod:`zerocc.ir.keyed_draws`): every random op of a
step draws from a seed of its own, so one process training under ``zerocc.keyed_draws``
draws the masks the compiled step draws, and nothing else a user draws moves them.

Tolerance 1e-5 relative, as tests/parity/test_parity.py: the step sums its micro-batches'
gradients and scales once, the reference scales each micro-batch's (a few ulps per step), and
Inductor's whole graph reorders fp32 sums (tests/parity/test_inductor_parity.py). A mask drawn
from another seed moves the loss by 1e-3 or more. The multi-rank and pipeline cases are in
tests/parity/test_parity.py and tests/parity/test_pipeline_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import build, entry, loss_of

import zerocc
from zerocc.ir.keyed_draws import SEED_DRAW, DrawKey, drawing_under

SEED = 7
TOL = 1e-5
PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "capture": {"draws": "keyed"},
    "optimizer": {"name": "adamw", "lr": 1e-2, "eps": 1e-3},
    "grad_accumulation": 2,
    "seed": SEED,
}
BATCH = entry("gpt_dropout")[1]


def _reference(model: torch.nn.Module, steps: int, accum: int) -> list[float]:
    """Losses of ``model`` trained by torch.optim, micro-batch ``m`` of step ``s`` drawing
    under key ``(SEED, s, m)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.0)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        for m in range(accum):
            batch = BATCH(s * accum + m, 0)
            with zerocc.keyed_draws(SEED, s, m):
                loss = loss_of(model(*batch))
            losses.append(float(loss.detach()))
            (loss / accum).backward()
        opt.step()
    return losses


def test_keys_give_unrelated_seeds_and_the_same_seed_twice():
    key = DrawKey(SEED, 3, 1)
    seeds = {key.seed_of(i) for i in range(100)}
    seeds |= {DrawKey(SEED, 3, m).seed_of(0) for m in range(2, 50)}
    seeds |= {DrawKey(SEED, s, 1).seed_of(0) for s in range(4, 50)}
    seeds |= {DrawKey(s, 3, 1).seed_of(0) for s in range(8, 50)}
    assert len(seeds) == 100 + 48 + 46 + 42  # no two fields' changes meet
    assert all(0 <= s < 2**63 for s in seeds)  # what a generator's manual_seed takes
    assert key.seed_of(5) == DrawKey(SEED, 3, 1).seed_of(5)


def test_every_random_op_is_seeded_in_forward_order():
    step = zerocc.compile(build("gpt_dropout"), PLAN)
    step(*BATCH(0, 0))
    seeds = [n for n in step.program.graph.nodes if n.target is SEED_DRAW]
    # dropout after the embeddings, then in each of 2 blocks: attention, both residuals
    assert [n.args[0] for n in seeds] == list(range(7))
    assert all(n.next.target is torch.ops.aten.bernoulli_.float for n in seeds)


@pytest.mark.parametrize("backend", ["eager", "inductor-whole"])
def test_one_rank_draws_what_one_process_draws_by_key(backend):
    """ZeRO-3 with every unit recomputed (the recompute replays its forward's draw), eager with
    gradient accumulation (each micro-batch's own key); the reference is torch.optim on the
    same model, its forwards under ``zerocc.keyed_draws``. Inductor compiles one program, not
    accumulation's two (a micro-batch's, the step's): one whole-graph compile is ~50 s of this
    2-core machine's suite, and the keys' micro-batch index is the eager case's."""
    model = build("gpt_dropout")
    reference = copy.deepcopy(model)
    accum = 2 if backend == "eager" else 1
    plan = {**PLAN, "recompute": {"units": "all"}, "backend": {"name": backend},
            "grad_accumulation": accum}  # fmt: skip
    step = zerocc.compile(model, plan)
    losses = [float(step(*BATCH(i, 0))) for i in range(6)]
    assert losses == pytest.approx(_reference(reference, 6 // accum, accum), rel=TOL, abs=0)
    if backend == "inductor-whole":  # the seeds in its chain of draws, the program compiled whole
        said = step.record().backend_notes
        assert said[0].startswith("inductor: the whole program compiled"), said
    state = step.full_state_dict()
    for name, value in reference.state_dict().items():
        if name in state:
            torch.testing.assert_close(state[name], value, rtol=TOL, atol=1e-6, msg=name)


def test_the_users_own_draws_neither_move_the_masks_nor_are_moved():
    """A step's draws come from its keys alone: the user's draws between steps change no
    mask, and the user's generator goes on after a step as if the step had drawn nothing."""
    plan = {**PLAN, "grad_accumulation": 1}
    plain = zerocc.compile(build("gpt_dropout"), plan)
    busy = zerocc.compile(build("gpt_dropout"), plan)
    torch.manual_seed(0)
    expected_user_draw = torch.rand(3)
    torch.manual_seed(0)
    first = float(busy(*BATCH(0, 0)))
    assert torch.equal(torch.rand(3), expected_user_draw)
    second = float(busy(*BATCH(1, 0)))
    assert [first, second] == [float(plain(*BATCH(i, 0))) for i in range(2)]
    generator_mode = zerocc.compile(build("gpt_dropout"), {**plan, "capture": {}})
    torch.manual_seed(1)
    assert float(generator_mode(*BATCH(0, 0))) != first  # (the masks do differ without keys)


def test_a_seed_draw_outside_a_step_says_what_is_missing():
    with pytest.raises(RuntimeError, match="no draw key set"):
        torch.ops.zerocc.seed_draw(0, torch.device("cpu"))
    with drawing_under(DrawKey(SEED, 0, 0), torch.device("cpu")):
        torch.ops.zerocc.seed_draw(0, torch.device("cpu"))
        inside = torch.rand(2)
    torch.manual_seed(DrawKey(SEED, 0, 0).seed_of(0))
    assert torch.equal(inside, torch.rand(2))


def test_the_reference_seeds_only_draws_from_the_default_generator():
    """An op given a generator of its own (a batch made in the body) is not counted: the
    key cannot reach its draws, and the compiled step does not seed it either."""
    with zerocc.keyed_draws(SEED, 0, 0) as mode:
        torch.randint(0, 5, (3,), generator=torch.Generator().manual_seed(1))
        torch.nn.functional.dropout(torch.ones(4), 0.5)
        torch.nn.functional.scaled_dot_product_attention(*torch.ones(3, 1, 2, 2), dropout_p=0.0)
    assert mode.index == 1
