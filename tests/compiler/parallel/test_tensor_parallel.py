"""Tensor parallelism (``parallel.tp``): the ranks' layout, how parameters are split, the
plan's checks, and the program and reports of a simulated 4-rank world (``FakeComm``) as 2
data-parallel × 2 tensor-parallel ranks. Training parity on real gloo ranks:
tests/parity/test_tp_parity.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from models import GPT_TP_LAYERS, TP_LAYERS, SmoothedLM, _gpt_batch, tiny_gpt
from multirank import run_ranks
from torch import nn

import zerocc
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.tensor_parallel import Split
from zerocc.errors import PlanError, RankMismatchError
from zerocc.inspect.estimate import estimate, inspect_plan
from zerocc.ir.nodes import info, op_name

EXAMPLES = Path(__file__).parents[3] / "examples" / "gpt"


def test_a_tp_group_is_neighbouring_ranks_and_zero_shards_across_groups():
    mesh = Mesh.of(8, 1, 2)
    assert (mesh.data_parallel, mesh.shard_size) == (4, 4)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [mesh.tp_rank(r) for r in range(8)] == [0, 1] * 4
    hybrid = Mesh.of(8, 2, 2)  # 2 replicas × 2 shards × 2 tp
    assert hybrid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hybrid.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "(rank = (replica × 2 + shard) × 2 + tp)" in hybrid.describe()
    big = Mesh.of(1024, 1, 8).describe()
    assert "layers split over the tp groups [0-7], [8-15], … (128 groups)" in big
    assert len(big) < 300


@pytest.mark.parametrize(("split", "shape"), [(Split(0, 2), (6, 4)), (Split(1, 4), (3, 8))])
def test_every_rank_takes_its_slice_and_the_slices_join_back(split, shape):
    full = torch.arange(24.0).reshape(shape)
    slices = [split.take(full, r) for r in range(split.parts)]
    assert all(s.shape == split.local_shape(shape) for s in slices)
    assert torch.equal(split.join(slices), full)


def test_a_fused_weight_splits_each_block_alike():
    """q, k and v stacked in one weight: each rank holds the same rows of each."""
    q, k, v = (torch.full((4, 2), float(i)) for i in range(3))
    split = Split(0, 2, blocks=3)
    mine = split.take(torch.cat([q, k, v]), 1)
    assert torch.equal(mine, torch.cat([q[2:], k[2:], v[2:]]))


def _plan(**parallel) -> dict:
    return {
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": 1.0},
        "parallel": {"tp": 2, "tp_layers": GPT_TP_LAYERS, **parallel},
        "backend": {"device": "cpu"},
    }


def _compile(plan: dict, world: int = 4, model: nn.Module | None = None) -> zerocc.TrainStep:
    torch.manual_seed(0)
    return zerocc.compile(model or tiny_gpt(), plan, comm=zerocc.FakeComm(world))


@pytest.mark.parametrize(
    ("layers", "says"),
    [
        ({"transformer.h.*.attn.q_proj": "colwise"}, "matches no module of the model .* Linear"),
        ({"transformer.h.*.ln_1": "colwise"}, "cannot be split colwise; allowed"),
        ({"transformer.wpe": "rowwise"}, "cannot be split rowwise"),
        # 48 outputs in 5 blocks over 2 ranks: 48 is no multiple of 10
        ({"transformer.h.*.attn.c_attn": {"style": "colwise", "fused": 5}}, "in 5 fused blocks"),
        # the output head is tied to the embedding: split one, split both alike
        ({"lm_head": "vocab"}, "is tied .* split differently"),
    ],
)
def test_a_layer_that_cannot_be_split_is_a_plan_error_naming_it(layers, says):
    with pytest.raises(PlanError, match=says):
        _compile(_plan(tp_layers=layers))


def test_attention_heads_stay_whole():
    with pytest.raises(PlanError, match="does not divide the model's n_head"):
        _compile(_plan(tp=4))  # the tiny GPT has 2 heads


def test_a_linear_with_its_own_forward_is_refused():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = tiny_gpt()
    model.transformer.h[0].mlp.c_fc = Scaled(16, 64)
    with pytest.raises(PlanError, match="overrides Linear.forward"):
        _compile(_plan(), model=model)


@pytest.mark.parametrize(
    ("parallel", "world", "says"),
    [
        ({"tp": 2, "tp_layers": {}}, 4, "names none"),
        ({"dp": 4}, 4, "dp 4 × tp 2 is 8 ranks, but the world size is 4"),
        ({"tp": 3}, 4, "parallel.tp: 3 does not divide the world size 4"),
    ],
)
def test_a_mesh_the_ranks_cannot_take_is_a_plan_error(parallel, world, says):
    with pytest.raises(PlanError, match=says):
        _compile(_plan(**parallel), world)


@pytest.mark.parametrize(
    ("split", "shape"),
    [(Split(1, 4), (3, 8)), (Split(0, 2, blocks=3), (12, 5)), (Split(0, 2, blocks=3), (12,))],
)
def test_a_slice_s_elements_are_strided_runs_of_the_whole_tensor(split, shape):
    """What a checkpoint records of a tp rank's slice: every range of its flattened elements,
    as at most three strided runs of the whole tensor's."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    row = split.row(split.local_shape(shape))
    for rank in range(split.parts):
        mine = split.take(full, rank).reshape(-1)
        assert torch.equal(split.to_whole(torch.arange(mine.numel()), rank, row), mine)
        for start in range(mine.numel()):
            for stop in range(start + 1, mine.numel() + 1):
                runs = split.runs(start, stop, rank, row)
                got = [
                    first + k * split.parts * row + i
                    for _, first, length, count in runs
                    for k in range(count)
                    for i in range(length)
                ]
                assert got == mine[start:stop].tolist() and len(runs) <= 3


def _tp_collectives(step: zerocc.TrainStep) -> list[tuple[str, str, str]]:
    return [
        (op_name(n.target).removeprefix("zerocc."), info(n).phase, info(n).note or "")
        for n in step.program.graph.nodes
        if op_name(n.target).endswith("_start") and n.args[-1] == "tp"
    ]


def test_the_program_holds_each_rank_s_slices_and_the_tp_collectives():
    step = _compile(_plan())
    step(*_gpt_batch(0, 0))
    block = next(u for u in step.units if u.name == "transformer.h.0")
    plain = _compile({**_plan(), "parallel": {}}, world=2)
    plain_block = next(u for u in plain.units if u.name == "transformer.h.0")
    # the block's linear weights are halved, its norms and rowwise biases kept whole
    halved = sum(p.numel for p in plain_block.params if p.param.shape != (16,) or "c_fc" in p.fqn)
    assert block.numel == plain_block.numel - halved // 2
    found = _tp_collectives(step)
    forward = [note for kind, phase, note in found if phase == "forward"]
    backward = [note for kind, phase, note in found if phase == "backward"]
    # per block: attention's and MLP's partial outputs; the embedding's lookups
    assert sum("partial outputs of rowwise" in n for n in forward) == 4
    assert sum("lookups of vocab transformer.wte" in n for n in forward) == 1
    # the loss on each rank's slice of the logits: no rank gathers them whole
    assert not any("all-gather the logits" in n for n in forward)
    for what in ("row maxima", "sums of exp", "target logits"):
        assert sum(f"{what} of the vocabulary-parallel cross-entropy" in n for n in forward) == 1
    # per block: attention's and MLP's input gradient; the head's input gradient
    assert sum("input gradient" in n for n in backward) == 5
    notes = [note for kind, phase, note in found if phase == "optimizer"]
    assert any("non-finite flags over the tp" in n for n in notes)
    assert any("squared grad norm over the tp" in n for n in notes)


def test_a_cross_entropy_it_does_not_compute_reads_the_gathered_logits():
    model = SmoothedLM()
    plan = {**_plan(), "units": {}, "parallel": {"tp": 2, "tp_layers": TP_LAYERS["smoothed"]}}
    step = _compile(plan, model=model)
    step(*_gpt_batch(0, 0))
    forward = [note for kind, phase, note in _tp_collectives(step) if phase == "forward"]
    assert sum("all-gather the logits of vocab head" in n for n in forward) == 1
    assert not any("cross-entropy" in n for n in forward)


def test_backward_s_all_reduce_of_an_input_gradient_runs_behind_the_weight_gradient():
    """The overlap pass issues it right after the input gradient's matmul, and its wait comes
    after the weight gradient's matmul: the collective overlaps it, as Megatron does."""
    step = _compile(_plan())
    step(*_gpt_batch(0, 0))
    nodes = list(step.program.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    colwise = [
        n
        for n in nodes
        if op_name(n.target) == "zerocc.all_reduce_start"
        and "input gradient of colwise" in (info(n).note or "")
    ]
    assert len(colwise) == 4
    for start in colwise:
        wait = next(iter(start.users))
        behind = [op_name(n.target) for n in nodes[at[start] + 1 : at[wait]]]
        assert "aten.mm" in behind, info(start).note


def test_sequence_parallelism_splits_the_partial_sums_along_the_sequence():
    step = _compile(_plan(sequence_parallel=True))
    step(*_gpt_batch(0, 0))
    found = _tp_collectives(step)
    forward = [(kind, note) for kind, phase, note in found if phase == "forward"]
    # each rowwise layer's partial outputs reduce-scattered (not all-reduced) along the sequence
    scattered = [n for k, n in forward if k == "reduce_scatter_start" and "rowwise" in n]
    assert len(scattered) == 4 and not any("partial outputs" in n for k, n in forward if
                                           k == "all_reduce_start")  # fmt: skip
    # the sequence is gathered where attention and the MLP begin (block 0's attention reads the
    # embedding's whole sequence), and into the head
    gathered = [n for k, n in forward if k == "all_gather_start" and "sequence into" in n]
    assert len(gathered) == 3 + 1, gathered
    # the norms' weights and the rowwise biases see this rank's tokens: gradients summed
    backward = [n for k, p, n in found if p == "backward"]
    assert any("used on every rank's tokens" in n for n in backward)


def test_sequence_parallelism_needs_tensor_parallelism():
    with pytest.raises(PlanError, match="sequence_parallel splits the sequence over the tp"):
        zerocc.load_plan({"parallel": {"sequence_parallel": True}})


def _given_own_batches(rank: int, world: int) -> str:
    """A training loop that gives each rank its own batch, not its data-parallel rank's."""
    step = zerocc.compile(tiny_gpt(), _plan())
    try:
        step(*_gpt_batch(0, rank))
    except RankMismatchError as exc:
        return str(exc)
    return "trained"


def test_the_ranks_of_a_tp_group_given_different_batches_stop_with_an_error():
    said = run_ranks(2, _given_own_batches, timeout=300)
    assert all("tensor-parallel group were given different batches (ranks 0 vs 1)" in s
               for s in said), said  # fmt: skip


def _random_states(rank: int, world: int) -> list:
    torch.manual_seed(1000 + rank)  # a training script seeding each rank its own way
    step = zerocc.compile(
        tiny_gpt(), {**_plan(), "parallel": {"tp": 2, "tp_layers": GPT_TP_LAYERS}}
    )
    return [torch.get_rng_state(), step.data_rank]


def test_the_ranks_of_a_tp_group_draw_the_same_random_numbers():
    """Dropout where every tp rank holds the whole tensor must draw one mask on all of them."""
    (first, _), (second, _) = run_ranks(2, _random_states, timeout=300)
    assert torch.equal(first, second)


def test_the_report_draws_the_mesh(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROCC_DUMP_DIR", str(tmp_path))
    step = _compile(_plan())
    step(*_gpt_batch(0, 0))
    report = (tmp_path / "report.html").read_text()
    assert ">Mesh</h2>" in report
    assert "<td>tp</td><td>2</td><td>2</td><td>[0, 1], [2, 3]</td>" in report
    assert "<td>dp</td><td>2</td><td>2</td><td>[0, 2], [1, 3]</td>" in report


def test_explain_draws_the_mesh_and_counts_bytes_per_group():
    step = _compile(_plan())
    step(*_gpt_batch(0, 0))
    text = step.explain()
    assert "mesh: 4 ranks = 2 shards × 2 tensor-parallel (rank = shard × 2 + tp)" in text
    assert "all_reduce (tp)" in text and "all_gather (tp)" in text


def _figures_70b(**parallel) -> tuple:
    """The 70B example's layers (two of its 80 blocks: the figures scale by block) on 1024
    meta-device ranks, its plan's parallel section changed as given."""
    plan = zerocc.load_plan(EXAMPLES / "70b-tp.yaml")
    plan.workload_args["n_layer"] = 2
    plan.parallel = plan.parallel.model_copy(update=parallel)
    inspection = inspect_plan(plan, 1024)
    return inspection, estimate(inspection)


def test_a_70b_model_as_dp_128_by_tp_8_estimates_per_rank_and_per_dimension():
    """Each rank's parameters are its tp slice sharded over 128 dp ranks; the tp group carries
    one all-reduce of a (T, C) activation per split layer pair, each way."""
    inspection, figures = _figures_70b(sequence_parallel=False)
    psi = sum(u.padded_numel for u in inspection.units)  # one tp rank's slice
    width, vocab, tokens = 8192, 32000, 2048
    block = 12 * width * width // 8 + 9 * width + 4 * width * 3 // 8 + width  # slices + whole
    assert psi == pytest.approx(2 * block + vocab * width // 8 + tokens * width + 2 * width, 1e-3)
    assert figures.model_states["params"] == psi * 2 // 128  # bf16, over the dp group
    assert figures.comm["all_gather"] == 2 * 2 * psi and figures.comm["reduce_scatter"] == 4 * psi
    activation = tokens * width * 2  # one bf16 (T, C) activation, all-reduced as 2 × its bytes
    # forward: two per block and the embedding's; backward: two per block and the head's
    assert figures.comm["all_reduce (tp)"] == pytest.approx(2 * activation * 10, rel=1e-3)
    # the cross-entropy's row maxima (fp32, 8 ranks'), not the logits (T × 32000 × 2 bytes)
    assert figures.comm["all_gather (tp)"] == tokens * 8 * 4


def test_sequence_parallelism_moves_the_same_bytes_in_halves():
    """Megatron's sequence parallelism: each all-reduce becomes a reduce-scatter and an
    all-gather of the same (T, C) activation; the embedding's and the first attention's stay
    all-reduces here (they read the whole sequence), a few percent more in all."""
    _, plain = _figures_70b(sequence_parallel=False)
    _, split = _figures_70b(sequence_parallel=True)
    tp_bytes = [sum(v for k, v in f.comm.items() if "(tp)" in k) for f in (plain, split)]
    assert tp_bytes[1] == pytest.approx(tp_bytes[0], rel=0.1)
    activation = 2048 * 8192 * 2
    assert split.comm["reduce_scatter (tp)"] == 8 * activation  # 2 per block, each way


@pytest.mark.parametrize("router_loss", [True, False])
def test_sequence_parallelism_refuses_a_loss_of_each_ranks_own_tokens(router_loss):
    """A mixture of experts' load-balancing loss is a statistic of the tokens: on a rank's
    chunk of the sequence it is that chunk's, and each tp rank would train on its own (the
    parity run differed at the first loss). Its experts alone are token by token: they run on
    the chunks as the norms do."""
    pytest.importorskip("transformers", reason='the Mixtral needs transformers: "zerocc[hf]"')
    from models import MIXTRAL_TP_LAYERS, MoECausalLM, _token_batch

    torch.manual_seed(0)
    model = MoECausalLM("mixtral", "grouped_mm", router_loss=router_loss)
    plan = {
        **_plan(sequence_parallel=True, tp_layers=MIXTRAL_TP_LAYERS),
        "units": {"classes": ["MixtralDecoderLayer"]},
    }
    step = _compile(plan, model=model)
    if router_loss:
        with pytest.raises(PlanError, match="parallel.sequence_parallel: the model.s loss depends"):
            step(*_token_batch(0, 0))
    else:
        assert math.isfinite(float(step(*_token_batch(0, 0))))
