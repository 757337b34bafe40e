"""Graph-level tests of the recompute pass (and its RNG replay ops), on a fake process group;
its memory saving predicted and measured on the example GPT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import build, tiny_gpt, tiny_gpt_dropout
from parity import batch_of
from torch import nn
from workload import workload

import zerocc
import zerocc.ir.rng  # noqa: F401  (registers zerocc.rng_state / zerocc.set_rng_state)
from zerocc.compiler.workload import Workload
from zerocc.cost.memory import predict_memory
from zerocc.errors import PassOrderError, PlanError
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name
from zerocc.ir.printing import format_program

NOTE = "recomputed: forward of "


def compiled(units, stage: int = 3, model=None, world: int = 2, **extra):
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "recompute": {"units": units},
        "overlap": {"enabled": False},  # the schedule as shard emits it
        **extra,
    }
    step = zerocc.compile(model or tiny_gpt(), plan, comm=zerocc.FakeComm(world))
    step(*batch_of({"model": "gpt"}, 0, 0))
    return step


def recomputed(step, unit: str | None = None) -> list[torch.fx.Node]:
    return [
        n for n in step.program.graph.nodes if (info(n).note or "").startswith(NOTE + (unit or ""))
    ]


def ops(step, name: str, phase: str | None = None) -> list[torch.fx.Node]:
    return [
        n
        for n in step.program.graph.nodes
        if op_name(n.target) == name and (phase is None or info(n).phase == phase)
    ]


# -- which units ------------------------------------------------------------------------------


def test_all_recomputes_every_block_in_backward_and_not_the_root():
    step = compiled("all")
    nodes = recomputed(step)
    assert {info(n).note for n in nodes} == {NOTE + "transformer.h.0", NOTE + "transformer.h.1"}
    assert all(info(n).phase == "backward" for n in nodes)
    for n in nodes:  # each copy comes from a module of the unit its note names
        unit = info(n).note.removeprefix(NOTE)
        assert info(n).module == unit or info(n).module.startswith(unit + "."), n
    assert "recompute" in [r.name for r in step.records]


def test_none_recomputes_nothing_and_runs_no_pass():
    step = compiled("none")
    assert not recomputed(step)
    assert "recompute" not in [r.name for r in step.records]


def test_explain_and_estimate_say_what_recomputation_costs():
    from zerocc.inspect.explain import recompute_cost

    step = compiled("all")
    cost = recompute_cost({True: step.program}, 1)
    assert cost["units"] == ["transformer.h.0", "transformer.h.1"]
    assert cost["ops"] == len(recomputed(step))
    # The blocks' forward again: more than nothing, less than a third of forward + backward.
    assert 0 < cost["flops"] < cost["step_flops"] / 3
    assert "recomputation: 2 units" in step.explain()
    assert recompute_cost({True: compiled("none").program}, 1)["ops"] == 0


def test_globs_select_units():
    assert {info(n).note for n in recomputed(compiled(["transformer.h.1"]))} == {
        NOTE + "transformer.h.1"
    }
    both = {info(n).note for n in recomputed(compiled(["*.h.[01]"]))}
    assert both == {NOTE + "transformer.h.0", NOTE + "transformer.h.1"}


def test_a_glob_that_matches_no_unit_is_a_plan_error():
    with pytest.raises(PlanError, match=r"recompute.units: pattern 'h\.9' matches no unit"):
        compiled(["h.9"])


def test_recompute_must_run_before_shard():
    plan = {
        "recompute": {"units": "all"},
        "passes": ["partition", "shard", "recompute", "optimizer", "overlap"],
    }
    with pytest.raises(PassOrderError, match="'recompute' must run before 'shard'"):
        zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(2))


# -- what backward reads ------------------------------------------------------------------------


def test_backward_reads_only_block_outputs_and_weights_of_a_checkpointed_block():
    inspection = inspect_plan(
        {"units": {"classes": ["Block"]}, "recompute": {"units": "all"}},
        2,
        Workload(tiny_gpt(), batches=lambda rank, world: iter([batch_of({"model": "gpt"}, 0, 0)])),
        keep_graphs=True,
    )
    gm = next(r.gm for r in inspection.stepping.records if r.name == "recompute")
    for node in gm.graph.nodes:
        module = info(node).module or ""
        if info(node).phase != "forward" or not module.startswith("transformer.h."):
            continue
        if not any(info(u).phase == "backward" for u in node.users):
            continue
        if all(a.op == "placeholder" for a in node.all_input_nodes):
            continue  # a weight's transpose: the shard pass re-derives it in backward
        block = ".".join(module.split(".")[:3])
        assert module == block and node.target is torch.ops.aten.add.Tensor, node
        outside = [
            u
            for u in node.users
            if info(u).phase == "forward" and not (info(u).module or "").startswith(block)
        ]
        assert outside, f"{node} is not {block}'s output"


def test_a_unit_with_nothing_saved_is_left_as_it_is():
    """A frozen backbone under a trainable adapter: backward never enters it."""
    plan = {"units": {"modules": ["backbone", "adapter"]}, "overlap": {"enabled": False}}
    programs = []
    for units in ("none", ["backbone*"]):
        step = zerocc.compile(
            build("frozen"), {**plan, "recompute": {"units": units}}, comm=zerocc.FakeComm(2)
        )
        step(*batch_of({"model": "frozen"}, 0, 0))
        programs.append(format_program(step.program))
    assert "recompute" in [r.name for r in step.records]
    assert programs[0] == programs[1]


# -- stage 3 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_stage3_gathers_a_unit_before_its_recompute(overlap):
    step = compiled("all", overlap={"enabled": overlap})
    at = {n: i for i, n in enumerate(step.program.graph.nodes)}
    for unit in ("transformer.h.0", "transformer.h.1"):
        first = min(at[n] for n in recomputed(step, unit))
        last = max(at[n] for n in recomputed(step, unit))
        (gather,) = [
            n for n in ops(step, "zerocc.all_gather_start", "backward") if info(n).unit == unit
        ]
        (free,) = [n for n in ops(step, "zerocc.free", "backward") if info(n).unit == unit]
        assert at[next(iter(gather.users))] < first  # waited on before the recompute reads it
        assert last < at[free]


# -- RNG replay ---------------------------------------------------------------------------------


def test_rng_ops_replay_a_draw_and_leave_the_generator_as_it_was():
    like = torch.empty(3)
    state = torch.ops.zerocc.rng_state(like)
    first = torch.rand(5)
    now = torch.ops.zerocc.rng_state(like)
    torch.ops.zerocc.set_rng_state(state, like)
    assert torch.equal(torch.rand(5), first)
    torch.ops.zerocc.set_rng_state(now, like)
    after = torch.rand(5)
    torch.ops.zerocc.set_rng_state(now, like)
    assert torch.equal(torch.rand(5), after) and not torch.equal(after, first)


def _compute_neighbour(node: torch.fx.Node, step: str) -> torch.fx.Node:
    """The nearest node before (``prev``) or after (``next``) that is not a collective's start
    or wait: those are what the overlap pass moves."""
    node = getattr(node, step)
    while info(node).stream == "comm":
        node = getattr(node, step)
    return node


@pytest.mark.parametrize("stage", [0, 3])
def test_each_recomputed_draw_is_bracketed_by_the_forward_state_and_a_restore(stage):
    overlap = {"enabled": True, "prefetch": 2, "bucket_mb": 1}  # collectives moved around
    step = compiled("all", stage=stage, model=tiny_gpt_dropout(), overlap=overlap)
    rng_state = "zerocc.rng_state"
    draws = [n for n in recomputed(step) if op_name(n.target) == "aten.bernoulli_"]
    assert len(draws) == 2 * 3  # per block: attention, and both residual dropouts
    for copy in draws:
        replay, restore = _compute_neighbour(copy, "prev"), _compute_neighbour(copy, "next")
        assert op_name(replay.target) == op_name(restore.target) == "zerocc.set_rng_state"
        saved = replay.args[0]  # taken in forward, right before the original draw
        assert info(saved).phase == "forward" and op_name(saved.target) == rng_state
        assert op_name(_compute_neighbour(saved, "next").target) == "aten.bernoulli_"
        now = _compute_neighbour(replay, "prev")
        assert op_name(now.target) == rng_state and restore.args[0] is now
    # The embeddings' dropout belongs to the root unit: drawn once, no state saved.
    assert len(ops(step, rng_state, "forward")) == len(draws)
    assert len(ops(step, "aten.bernoulli_")) == 2 * len(draws) + 1


# -- side effects -------------------------------------------------------------------------------


class WithBatchNorm(nn.Module):
    """Batch norm updates its running statistics in forward: recomputing it would do it twice."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.body(x))), y)


class ReadsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = h * 3
        z.add_(1)  # in place on what ``h * 3`` allocated: kept with it, not replayed on it
        return self.lin(torch.exp(h) * torch.tanh(z))


class OverwritesItsInput(nn.Module):
    """The unit's input is overwritten in place after the unit ran: copies of ``exp(h)`` and
    ``h * 3`` in backward would read the new values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.body, self.head = nn.Linear(6, 6), ReadsItsInput(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = self.body(h)
        h.add_(1)
        return F.cross_entropy(self.head(out + h), y)


def _train(cls, units, steps: int = 2):
    torch.manual_seed(0)
    plan = {"zero": {"stage": 3}, "units": {"modules": ["body"]}}
    step = zerocc.compile(cls(), {**plan, "recompute": {"units": units}})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)
    losses = [float(step(x, y)) for _ in range(steps)]
    return step, losses, step.full_state_dict()


@pytest.mark.parametrize("cls", [WithBatchNorm, OverwritesItsInput])
def test_side_effects_are_kept_not_duplicated(cls):
    step, losses, state = _train(cls, ["body"])
    _, expected_losses, expected = _train(cls, "none")
    assert losses == expected_losses
    for name, value in expected.items():  # running statistics included
        assert torch.equal(state[name], value), name
    # torch < 2.5 traces a training batch norm as the in-place _native_batch_norm_legit
    norms = ops(step, "aten.native_batch_norm") + ops(step, "aten._native_batch_norm_legit")
    assert len(norms) == (cls is WithBatchNorm)
    assert recomputed(step, "body")  # the rest of the unit is still recomputed
    if cls is OverwritesItsInput:
        for name in ("aten.exp", "aten.mul"):
            kept = [n for n in ops(step, name, "forward") if info(n).module == "body"]
            assert kept and info(kept[0]).note.startswith("kept for backward, not recomputed")
        assert not [n for n in recomputed(step) if op_name(n.target) == "aten.add_"]


# -- memory -------------------------------------------------------------------------------------

GPT4 = {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4}


@pytest.fixture(scope="module")
def activation_peaks() -> dict[str, dict[str, int]]:
    """Peak activation bytes of the example GPT (4 blocks, stage 3, one process), predicted
    from the scheduled program and measured running it, without and with recompute."""
    peaks: dict[str, dict[str, int]] = {"predicted": {}, "measured": {}}
    for units in ("none", "all"):
        work = workload(**GPT4)
        plan = {
            "zero": {"stage": 3},
            "units": {"classes": ["Block"]},
            "recompute": {"units": units},
        }
        step = zerocc.compile(work.model, plan)
        batches = work.batches(0, 1)
        step(*next(batches))
        _, recorder = step.profile(*next(batches))
        predicted = predict_memory(step.program, step.model_state_bytes())
        peaks["predicted"][units] = max(predicted.series["activations"])
        peaks["measured"][units] = max(recorder.timeline.series["activations"])
    return peaks


@pytest.mark.parametrize("kind", ["predicted", "measured"])
def test_recompute_halves_the_peak_of_activations(activation_peaks, kind):
    peaks = activation_peaks[kind]
    assert peaks["all"] <= peaks["none"] / 2, peaks
