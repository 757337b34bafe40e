"""The ranks' agreement on each micro-batch (zerocc/runtime/agreement.py, TrainStep): issued at
once and settled right before the first collective of a cached program whose run writes nothing
before it, so that its round trip runs behind that work; settled before the run otherwise, and
before compiling. Disagreements found that late are still errors on every rank with nothing written,
the groups stay usable, and the ranks' control traffic goes through the gloo control group.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import build
from multirank import run_ranks
from parity import batch_of
from torch import nn

import zerocc
from zerocc.errors import DataExhaustedError, RankMismatchError

GPT = {"model": "gpt"}


def _plan(stage: int, device: str = "cpu", **extra) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": {"eps": 1e-3},
        "backend": {"device": device},
        **extra,
    }


def _batch_norm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _programs(model: nn.Module, plan: dict, batches: list[tuple], loss_fn=None) -> list:
    step = zerocc.compile(model, plan, loss_fn=loss_fn, comm=zerocc.FakeComm(2))
    for batch in batches:
        step(*batch)
    return list(step.programs.values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_programs_that_write_nothing_before_their_first_collective_agree_there(stage):
    """Without accumulation no gradient is state: nothing is written before the first
    reduction."""
    (program,) = _programs(build("gpt"), _plan(stage), [batch_of(GPT, 0, 0)])
    assert program.agrees_at_first_collective


def test_a_program_that_writes_before_its_first_collective_agrees_before_it_runs():
    """Batch norm updates its running statistics in forward, before stage 2's first
    reduce-scatter. With accumulation, stage 1 adds each micro-batch's gradient into its
    accumulator before the stepping program reduces it, and the accumulating program has no
    collective at all; stage 3 adds reduced shards, after its first collective."""

    def loss_fn(model, x):
        return model(x).pow(2).mean()

    plan = _plan(2, units={})
    (program,) = _programs(_batch_norm_model(), plan, [(torch.arange(12.0).view(3, 4),)], loss_fn)
    assert not program.agrees_at_first_collective
    two = [batch_of(GPT, 0, 0), batch_of(GPT, 1, 0)]
    accumulate, step = _programs(build("gpt"), _plan(1, grad_accumulation=2), two)
    assert not accumulate.agrees_at_first_collective and not step.agrees_at_first_collective
    accumulate, step = _programs(build("gpt"), _plan(3, grad_accumulation=2), two)
    assert accumulate.agrees_at_first_collective and step.agrees_at_first_collective


# -- on two gloo ranks ------------------------------------------------------------------------


def _where_settled(rank: int, world: int, stage: int) -> list[tuple[bool, int]]:
    """For each call: whether the agreement was settled while the program ran, and how many
    collectives the program had issued by then."""
    from zerocc.backends.eager.executable import EagerExecutable
    from zerocc.runtime.agreement import RankAgreement

    step = zerocc.compile(build("gpt"), _plan(stage))
    seen: list[tuple[bool, int]] = []
    settle, run = RankAgreement.settle, EagerExecutable.__call__
    running = [False]

    def recording(self, agreement):
        seen.append((running[0], sum(self.comm.stats.calls.values())))
        return settle(self, agreement)

    def tracked(self, *args):
        running[0] = True
        try:
            return run(self, *args)
        finally:
            running[0] = False

    RankAgreement.settle, EagerExecutable.__call__ = recording, tracked
    for i in range(3):
        step(*batch_of(GPT, i, rank))
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_a_cached_program_settles_the_agreement_at_its_first_collective(stage):
    for seen in run_ranks(2, _where_settled, stage, timeout=300):
        # The first call compiles: settled before; the cached ones: inside the run, before
        # any collective was issued (at stage 2, after forward and part of backward).
        assert seen[0][0] is False
        assert seen[1:] == [(True, 0), (True, 0)]


def _state(step: zerocc.TrainStep) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in step.full_state_dict().items()}


def _disagree_then_go_on(rank: int, world: int, device: str = "cpu") -> dict:
    """Disagreements found at the first collective of a cached program (and one found before
    compiling), each an error on both ranks that writes nothing; then both train on."""
    step = zerocc.compile(build("gpt"), _plan(3, device))
    short = batch_of(GPT, 9, rank)[0][:1], batch_of(GPT, 9, rank)[1][:1]
    step(*short)  # both ranks compile the program of this shape too
    step(*batch_of(GPT, 0, rank))
    errors, unchanged = [], []

    def expect_error(call) -> None:
        before = _state(step)  # a collective: the groups must still agree on what runs
        try:
            call()
            errors.append("no error")
        except (DataExhaustedError, RankMismatchError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        unchanged.append(all(torch.equal(v, _state(step)[k]) for k, v in before.items()))

    # Rank 1 has no batch left while rank 0 runs a cached program.
    expect_error(lambda: step.end_of_data() if rank == 1 else step(*batch_of(GPT, 1, rank)))
    # Both run cached programs, of different shapes.
    expect_error(lambda: step(*(short if rank == 1 else batch_of(GPT, 1, rank))))
    # Rank 0 has a new shape (it would compile), rank 1 runs a cached program.
    other = batch_of(GPT, 1, rank)[0][:, :4], batch_of(GPT, 1, rank)[1][:, :4]
    expect_error(lambda: step(*(other if rank == 0 else batch_of(GPT, 1, rank))))
    losses = [float(step(*batch_of(GPT, i, rank))) for i in (1, 2)]
    clean = zerocc.compile(build("gpt"), _plan(3, device))
    clean(*short)
    clean_losses = [float(clean(*batch_of(GPT, i, rank))) for i in (0, 1, 2)]
    return {
        "errors": errors,
        "unchanged": unchanged,
        "programs": len(step.programs),
        "losses": losses,
        "clean_losses": clean_losses[1:],
        "same_state": all(torch.equal(v, _state(clean)[k]) for k, v in _state(step).items()),
    }


@functools.cache
def _disagreements() -> list[dict]:
    return run_ranks(2, _disagree_then_go_on, timeout=300)


def _assert_every_rank_stopped(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        ended, shapes, new = result["errors"]
        assert ended.startswith(
            f"DataExhaustedError: rank {rank}, step 3: rank(s) 1 ran out of batches while "
            "rank(s) 0 still had one"
        )
        for error in (shapes, new):
            assert error.startswith(
                f"RankMismatchError: rank {rank}, step 3: the batch shapes differ across ranks"
            )
        assert result["programs"] == 2  # nobody compiled the third shape
        assert result["unchanged"] == [True, True, True]


def test_disagreements_found_at_the_first_collective_stop_every_rank():
    _assert_every_rank_stopped(_disagreements())


def test_after_a_disagreement_training_goes_on_as_if_it_had_not_been():
    for result in _disagreements():
        assert result["losses"] == result["clean_losses"] and result["same_state"]


@pytest.mark.two_gpus
def test_on_nccl_disagreements_stop_every_rank_through_the_gloo_control_group():
    results = run_ranks(2, _disagree_then_go_on, "cuda", backend="nccl", timeout=300)
    _assert_every_rank_stopped(results)
    for result in results:  # GPU kernels need not be bit-reproducible from run to run
        assert result["losses"] == pytest.approx(result["clean_losses"], rel=1e-5)


def _control_traffic(rank: int, world: int) -> dict:
    """Which groups the agreements, the memory check and a mismatch's views went through."""
    import torch.distributed as dist

    used: list[object] = []
    for name in ("all_gather", "all_gather_object"):
        collective = getattr(dist, name)

        def recording(*args, _collective=collective, **kwargs):
            used.append(kwargs.get("group"))
            return _collective(*args, **kwargs)

        setattr(dist, name, recording)
    step = zerocc.compile(build("gpt"), _plan(2))
    for i in range(2):
        step(*batch_of(GPT, i, rank))
    x, y = batch_of(GPT, 2, rank)
    try:  # rank 1's batch is shorter: a mismatch, whose views are gathered too
        step(*((x[:1], y[:1]) if rank == 1 else (x, y)))
    except RankMismatchError:
        pass
    comm = step.comm
    groups = (comm.group, comm.control_group)
    result = {
        "calls": len(used),
        "all_on_control": all(g is comm.control_group for g in used),
        "backends": [dist.get_backend(g) for g in groups],
        "distinct": comm.group is not comm.control_group,
    }
    comm.close()
    result["released"] = [g not in dist.distributed_c10d._world.pg_map for g in groups]
    return result


def test_control_traffic_goes_through_the_gloo_control_group_released_with_the_data_group():
    for result in run_ranks(2, _control_traffic, timeout=300):
        assert result["calls"] >= 4 and result["all_on_control"], result
        assert result["backends"] == ["gloo", "gloo"] and result["distinct"]
        assert result["released"] == [True, True]


def _groups_for_cuda(rank: int, world: int) -> list[str | None]:
    """The backends TorchComm.create asks for when the ranks' tensors are on CUDA (recorded,
    then made with gloo: this machine has no NCCL)."""
    import torch.distributed as dist

    from zerocc.engine.comm import TorchComm

    asked: list[str | None] = []
    new_group = dist.new_group

    def recording(*args, backend=None, **kwargs):
        asked.append(backend)
        return new_group(*args, backend="gloo", **kwargs)

    dist.new_group = recording
    TorchComm.create(30, torch.device("cuda", rank)).close()
    return asked


def test_on_cuda_the_data_group_is_nccl_and_the_control_group_gloo():
    for asked in run_ranks(2, _groups_for_cuda, timeout=120):
        assert asked == ["nccl", "gloo"]


def _own_plans(rank: int, world: int, field: str, values: tuple) -> tuple[str, list[float]]:
    """Rank ``rank`` compiles its own plan, ``field`` set to ``values[rank]``: the error that
    stopped it ("" if none), and the losses of the steps it trained."""
    section, _, name = field.partition(".")
    plan = _plan(3)
    plan[section] = {**plan.get(section, {}), name: values[rank]}
    try:
        step = zerocc.compile(build("gpt"), plan)
    except RankMismatchError as exc:
        return str(exc), []
    return "", [float(step(*batch_of(GPT, i, rank))) for i in range(2)]


def test_ranks_whose_plans_differ_stop_before_making_their_groups():
    """A learning rate changes no compiled program: ranks with their own plans would each
    update their shards by their own. Every rank stops, naming the field and each value; a
    folder each host may set its own way (checkpoint.dir) is not compared."""
    for error, losses in run_ranks(2, _own_plans, "optimizer.lr", (1e-3, 1e-2)):
        assert not losses
        assert "the ranks do not start alike" in error, error
        assert "rank 0: optimizer.lr: 0.001; rank 1: optimizer.lr: 0.01" in error, error
    for error, losses in run_ranks(2, _own_plans, "checkpoint.dir", ("/host/a", "/host/b")):
        assert error == "" and len(losses) == 2


def _own_torch(rank: int, world: int) -> str:
    """Rank 1 runs another torch release (as a host with an older image would)."""
    if rank == 1:
        torch.__version__ = "2.11.0"
    try:
        zerocc.compile(build("gpt"), _plan(3))
    except RankMismatchError as exc:
        return str(exc)
    return ""


def test_ranks_on_other_torch_releases_stop_naming_each():
    for error in run_ranks(2, _own_torch):
        assert f"rank 0: torch {torch.__version__}; rank 1: torch 2.11.0" in error, error


def _own_models(rank: int, world: int, pp: int) -> tuple[str, float]:
    """Rank ``rank`` builds a GPT of 2 + rank blocks (the same plan): the error and how long
    compiling took to raise it."""
    import time

    from model import GPT as ExampleGPT
    from model import GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2 + rank, n_head=2, n_embd=16)
    plan = _plan(3, units={"classes": ["Block"]})
    if pp > 1:
        plan["parallel"] = {"pp": pp}
    began = time.monotonic()
    try:
        zerocc.compile(ExampleGPT(config), plan)
    except RankMismatchError as exc:
        return str(exc), time.monotonic() - began
    return "", time.monotonic() - began


@pytest.mark.parametrize("pp", [1, 2], ids=["zero3", "pipeline"])
def test_ranks_that_built_different_models_stop_naming_the_first_tensor(pp):
    """Rank 1 built one more block than rank 0: every rank stops before the first broadcast of
    the weights (which would wait for the timeout), naming the first tensor that differs."""
    for error, seconds in run_ranks(2, _own_models, pp, timeout=120):
        assert "the ranks do not start alike" in error, error
        first = (
            "rank 0: parameter transformer.ln_f.weight [16] torch.float32; rank 1: parameter "
            "transformer.h.2.ln_1.weight [16]"
        )
        assert first in error, error
        assert seconds < 30


def _one_step_ahead(rank: int, world: int, pp: int = 1) -> tuple[str, float]:
    """Rank 0 trains one step more than rank 1, then both ask for the full state dict."""
    import time

    step = zerocc.compile(build("gpt"), _plan(3, **({"parallel": {"pp": pp}} if pp > 1 else {})))
    for i in range(2):
        step(*batch_of(GPT, i, step.data_rank))
    began = time.monotonic()
    try:
        if rank == 0:
            step(*batch_of(GPT, 2, step.data_rank))
        step.full_state_dict()
    except RankMismatchError as exc:
        return str(exc), time.monotonic() - began
    return "", time.monotonic() - began


@pytest.mark.parametrize("pp", [1, 2], ids=["zero3", "pipeline"])
def test_a_rank_a_step_ahead_of_a_collective_outside_the_step_is_named_at_once(pp):
    """Rank 1 calls full_state_dict() while rank 0 is in a step: each is told where the other
    is, in seconds, not after the timeout of collectives that do not match."""
    errors = run_ranks(2, _one_step_ahead, pp, timeout=120)
    where = "rank 0: ('next batch', (('tensor', (2, 8)"
    for error, seconds in errors:
        assert "the ranks are not at the same point" in error, errors
        assert where in error and "rank 1: full_state_dict() after micro-batch 2" in error, errors
        assert seconds < 30, errors
