"""Walking a pipeline schedule over stage programs (zerocc/runtime/pipeline.py), every rank in
one process: every schedule gives each micro-batch the loss the whole captured step gives it,
and each parameter the sum over micro-batches of the whole step's gradients.

The oracle is the captured step run whole on each micro-batch. Losses are bit-identical (the
same ops on the same values). Gradients are summed over micro-batches in the order a stage's
backward runs them, which a schedule may choose: fp32 to 1e-6 relative, the oracle's bound for
a sum in another order (what the schedules here do run in micro-batch order is also exact)."""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch
from multirank import run_ranks
from staging import SCHEDULE_CASES, blocks, captured, gpt, model_inputs, walked, whole

import zerocc
from zerocc.compiler.parallel.pipeline_schedule import pipeline_schedule
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import split_backward
from zerocc.errors import BatchError, NonFiniteError, NotSupportedError
from zerocc.runtime.pipeline import (
    TorchTransport,
    captured_rank,
    microbatches_of,
    run_in_one_process,
)

MICROBATCHES = 4


@pytest.mark.parametrize(("name", "pp", "stages_per_rank"), SCHEDULE_CASES)
def test_every_schedule_trains_each_microbatch_as_the_whole_step(name, pp, stages_per_rank):
    w = walked(name, pp, stages_per_rank, MICROBATCHES)
    model, microbatches, gm, info, schedule, ranks = (
        w.model, w.microbatches, w.gm, w.info, w.schedule, w.ranks
    )  # fmt: skip

    runs = [whole(gm, info, model, batch) for batch in microbatches]
    last = ranks[schedule.rank_of(schedule.stages - 1)].rank
    for m, (loss, _) in enumerate(runs):
        assert torch.equal(last.losses[m], loss)
    pipelined: dict[str, torch.Tensor] = {}
    for rank in ranks:  # a tied parameter's parts, from the ranks that hold its stages
        for fqn, grad in rank.grads.items():
            pipelined[fqn] = pipelined[fqn] + grad if fqn in pipelined else grad
    expected = {fqn: sum(grads[fqn] for _, grads in runs) for fqn in runs[0][1]}
    assert pipelined.keys() == expected.keys()
    for fqn, grad in expected.items():
        torch.testing.assert_close(pipelined[fqn], grad, rtol=1e-6, atol=1e-7, msg=fqn)
    assert all(not r.rank.kept for r in ranks)  # every stash was freed after its backward


def test_the_input_gradient_half_sends_what_the_whole_backward_sends():
    model = gpt(4)
    gm, info = captured(model, _gpt_batch(0, 0))
    middle = cut_stages(gm, info, blocks(4, 4)).stages[1].backward
    input_grad, weight_grad = split_backward(middle)
    assert input_grad.writes("send") == middle.writes("send")
    # Every gradient comes out once; the first half computes only those that an op of the
    # input gradient computes beside it (a layer norm's weight and bias).
    halves = input_grad.writes("grad") + weight_grad.writes("grad")
    assert sorted(halves) == sorted(middle.writes("grad"))
    assert all(".ln_" in fqn for fqn in input_grad.writes("grad"))
    # The weight gradient's matmuls are the second half's: the first holds only what the
    # input gradient needs (one matmul per linear layer, not two).
    mms = [sum(n.target is torch.ops.aten.mm.default for n in p.gm.graph.nodes)
           for p in (middle, input_grad, weight_grad)]  # fmt: skip
    assert mms[1] + mms[2] == mms[0] and mms[1] == mms[2]


def _pipeline_rank(rank: int, world: int, name: str, stages_per_rank: int):
    """One rank of a ``world``-rank pipeline over gloo: its losses and gradients."""
    model = gpt(4)
    microbatches = [_gpt_batch(m, 0) for m in range(MICROBATCHES)]
    gm, info = captured(model, microbatches[0])
    staged = cut_stages(gm, info, blocks(4, world * stages_per_rank))
    schedule = pipeline_schedule(name, world, MICROBATCHES, stages_per_rank)
    transport = TorchTransport(staged, MICROBATCHES, schedule.rank_of)
    inputs = model_inputs(model, microbatches)
    mine = captured_rank(
        staged, info, schedule.stages_of(rank), schedule.splits_backward, transport, inputs
    )
    for action in schedule.actions[rank]:
        mine.rank.run(action)
    transport.finish()
    torch.distributed.barrier()  # a peer may still be reading what this rank sent last
    return mine.rank.losses, mine.grads


@pytest.mark.parametrize(("name", "stages_per_rank"), [("1f1b", 1), ("zero-bubble", 2)])
def test_two_gloo_ranks_walk_their_schedules_to_the_one_process_result(name, stages_per_rank):
    """The same pipeline as above, each rank in its own process, sending over gloo: the
    losses and gradients of the one-process walk, bit for bit (the same programs on the same
    values, in the same order on each rank, with one thread as the ranks run)."""
    results = run_ranks(2, _pipeline_rank, name, stages_per_rank)
    model = gpt(4)
    microbatches = [_gpt_batch(m, 0) for m in range(MICROBATCHES)]
    gm, info = captured(model, microbatches[0])
    staged = cut_stages(gm, info, blocks(4, 2 * stages_per_rank))
    schedule = pipeline_schedule(name, 2, MICROBATCHES, stages_per_rank)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matmul's sums then run in the ranks' order
    try:
        local = run_in_one_process(staged, info, schedule, model_inputs(model, microbatches))
    finally:
        torch.set_num_threads(threads)
    for (losses, grads), here in zip(results, local, strict=True):
        assert losses.keys() == here.rank.losses.keys()
        assert all(torch.equal(losses[m], here.rank.losses[m]) for m in losses)
        assert grads.keys() == here.grads.keys()
        assert all(torch.equal(grads[k], here.grads[k]) for k in grads)
    assert len(results[schedule.rank_of(schedule.stages - 1)][0]) == MICROBATCHES


def test_a_batch_is_cut_into_microbatches_along_its_first_dimension():
    x, y, scale = torch.arange(12).view(6, 2), torch.arange(6), 0.5
    parts = microbatches_of((x, y, scale), 3)
    assert [p[0].tolist() for p in parts] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8, 9], [10, 11]],
    ]
    assert all(p[2] == scale for p in parts)
    with pytest.raises(
        BatchError, match="divide by 4; the batch's tensors are \\[\\[6, 2\\], \\[6\\]\\]"
    ):
        microbatches_of((x, y), 4)


@pytest.mark.parametrize("defer", ["next_forward", "delayed"])
def test_a_pipeline_refuses_deferred_host_updates_which_it_does_not_combine_with_yet(defer):
    plan = {"parallel": {"pp": 2}, "zero": {"stage": 3}, "backend": {"device": "cpu"},
            "offload": {"optimizer": "cpu", "defer_updates": defer}}  # fmt: skip
    with pytest.raises(NotSupportedError, match=f"offload.defer_updates: {defer}; set it to none"):
        zerocc.compile(gpt(4), plan, comm=zerocc.FakeComm(world_size=2))


PLAN = {
    "parallel": {"pp": 2}, "pipeline": {"microbatches": 2}, "units": {"classes": ["Block"]},
    "backend": {"device": "cpu"},
}  # fmt: skip


def _disagreeing(rank: int, world: int, how: str) -> None:
    step = zerocc.compile(gpt(4), PLAN)
    step(*_gpt_batch(0, 0))  # a step both train: the stages are cut
    if how == "out of data" and rank == 0:
        step.end_of_data()
    else:  # rank 1's batch differs from rank 0's in one token
        x, y = _gpt_batch(1, 0)
        step(x + (rank == 1 and how == "other batch"), y)


@pytest.mark.parametrize(
    ("how", "error", "says"),
    [
        ("out of data", "DataExhaustedError", "rank(s) 0 ran out of batches while rank(s) 1"),
        ("other batch", "RankMismatchError", "the ranks of a pipeline were given different"),
    ],
)
def test_the_ranks_of_a_pipeline_agree_on_each_step_or_fail_together(how, error, says):
    """A rank out of data, or a pipeline's ranks given different batches, is an error on every
    rank at that step, naming the ranks: not neighbours waiting forever for a tensor that
    never comes, nor a last stage reading labels of another batch than the first's tokens."""
    with pytest.raises(RuntimeError) as failed:
        run_ranks(2, _disagreeing, how, timeout=120)
    assert [e[0] for e in failed.value.errors.values()] == [error, error]
    assert all(says in message for _, message in failed.value.errors.values())


def _dropout_pipeline(rank: int, world: int) -> dict:
    """The dropout GPT as pp 2, recomputing every block or none, then an evaluation."""
    from models import tiny_gpt_dropout

    out = {}
    parts = zip(*(_gpt_batch(m, 0) for m in range(4)), strict=True)
    batch = tuple(torch.cat(part) for part in parts)
    for recompute in ("none", "all"):
        torch.manual_seed(0)
        plan = {**PLAN, "pipeline": {"microbatches": 4}, "recompute": {"units": recompute},
                "seed": 5}  # fmt: skip
        step = zerocc.compile(tiny_gpt_dropout(), plan)
        losses = [float(step(*batch)) for _ in range(3)]
        evaluated = [float(step.evaluate(*batch)) for _ in range(2)]
        trained = float(step(*batch))
        out[recompute] = {"losses": losses, "evaluated": evaluated, "trained": trained,
                          "params": step.full_state_dict()}  # fmt: skip
    return out


def test_dropout_in_a_pipeline_is_replayed_by_recompute_and_off_in_evaluation():
    """Dropout under a pipeline: recomputing every block replays the masks its forward drew
    (the same losses and weights as keeping them, to fp32 rounding: the recomputed forward runs
    the same ops on the same values); evaluation runs in eval mode (the same loss twice, and
    not the loss training reports on the same batch from the same weights)."""
    for rank in run_ranks(2, _dropout_pipeline):
        kept, recomputed = rank["none"], rank["all"]
        assert recomputed["losses"] == pytest.approx(kept["losses"], rel=1e-6)
        for name, value in kept["params"].items():
            torch.testing.assert_close(recomputed["params"][name], value, rtol=1e-6, atol=1e-7)
        first, again = kept["evaluated"]
        assert first == again
        assert kept["trained"] != first  # the training step drew masks: dropout is on there


class _PoisonedBias(torch.nn.Module):
    """tests/runtime/test_nonfinite.py's model: the loss reads the batch's ``gain`` only through
    the last element of ``second.bias``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        out = self.second(torch.tanh(self.first(x)))  # (B, 3)
        return torch.nn.functional.mse_loss(out, y) + gain * self.second.bias[-1]


def _poisoned(step: int, poison: float | None) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    gain = torch.tensor(poison if poison is not None else 0.0)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g), gain


def _nonfinite(rank: int, world: int, mode: str) -> dict:
    """That model as a pipeline of 2 stages (``first``, ``second``) on the same batches: its
    gradient is inf at step 2, under ``precision.on_nonfinite: mode``."""
    plan = {"parallel": {"pp": 2}, "pipeline": {"microbatches": 2},
            "units": {"modules": ["first", "second"]}, "optimizer": {"eps": 1e-3},
            "precision": {"on_nonfinite": mode}, "backend": {"device": "cpu"}}  # fmt: skip
    step = zerocc.compile(_PoisonedBias(), plan)
    out: dict = {"errors": [], "losses": []}
    for s in range(3):
        poison = float("inf") if s == 1 else None
        if s == 1:
            before, counters = step.full_state_dict(), (step.steps, step.micro_batches)
        try:
            out["losses"].append(float(step(*_poisoned(s, poison))))
        except NonFiniteError as exc:
            out["errors"].append(str(exc))
        if s == 1:
            after = step.full_state_dict()
            out["changed"] = [n for n, t in before.items() if not torch.equal(t, after[n])]
            out["counters"] = counters, (step.steps, step.micro_batches)
    out["skipped"] = step.summary()["skipped_steps"]
    return out


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_a_non_finite_step_of_a_pipeline_stops_or_skips_on_every_rank_writing_nothing(mode):
    """As a TrainStep's (tests/runtime/test_nonfinite.py): ``error`` is a NonFiniteError on
    every rank naming the step, the step's batch discarded (counters as before it); ``skip``
    skips it on every rank; either way no weight changes, and training goes on after."""
    for rank, got in enumerate(run_ranks(2, _nonfinite, mode, timeout=180)):
        assert got["changed"] == [], got["changed"]
        assert len(got["losses"]) == (2 if mode == "error" else 3)
        assert all(torch.isfinite(torch.tensor(got["losses"][:1] + got["losses"][-1:])))
        before, after = got["counters"]
        if mode == "error":
            (message,) = got["errors"]
            assert f"rank {rank}, step 2:" in message and "on_nonfinite: skip" in message
            assert before == after and got["skipped"] == 0
        else:
            assert got["errors"] == [] and got["skipped"] == 1
            assert after == (before[0], before[1] + 1)
