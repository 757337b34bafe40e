"""The stage cut (zerocc/compiler/parallel/stage_cut.py): the captured step cut into pipeline
stages computes what the whole step computes. The oracle is the captured step itself, run
whole on real tensors: its stages, run one after another as a pipeline runs them (every
forward in order, each sending its activations on, then every backward in reverse, each
sending its input's gradient back), give the same loss and, bit for bit, the same gradients
(the same ops on the same values; a tied parameter's two parts are summed as the whole step
sums them, once, in the same order)."""

from __future__ import annotations

import pytest
import torch
from models import CausalLM, MoECausalLM, _gpt_batch, _token_batch
from staging import CPU, blocks, captured, gpt, whole
from torch import nn

from zerocc.compiler.capture import Casts
from zerocc.compiler.driver.pass_manager import PassContext, bind_passes, run_passes
from zerocc.compiler.driver.pipeline import cut_step
from zerocc.compiler.float8 import Float8Layers
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import (
    StagedStep,
    split_backward,
    stage_model,
    step_form,
    update_graph,
)
from zerocc.compiler.passes.partition import assign_units
from zerocc.compiler.plan import Plan
from zerocc.errors import PlanError
from zerocc.ir.kinds import Role
from zerocc.ir.nodes import PARAM, count_ops
from zerocc.ir.printing import format_program
from zerocc.ir.verify import verify_program


def _pipelined(staged: StagedStep, model: nn.Module, batch: tuple):
    """Loss and gradients of the stages run as a pipeline runs one micro-batch: forward stage
    by stage, then backward in reverse; a tied parameter's parts summed after backward."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    sent, kept, grads, loss = {}, {}, {}, None

    def run(program, received):
        fixed = {Role.PARAM: params, Role.BUFFER: buffers, Role.BATCH: dict(enumerate(batch))}
        args = []
        for slot in program.inputs:
            held = fixed.get(slot.kind)
            value = held[int(slot.key) if slot.kind == Role.BATCH else slot.key] if held else None
            args.append(received[slot.key] if value is None else value)
            assert tuple(args[-1].shape) == slot.shape, slot
        return zip(program.outputs, program.gm(*args), strict=True)

    for stage in staged.stages:
        for slot, value in run(stage.forward, sent):
            if slot.kind == "send":
                sent[slot.key] = value
            elif slot.kind == "stash":
                kept[stage.index, slot.key] = value
            else:
                loss = value
    for stage in reversed(staged.stages):
        mine = {k: v for (s, k), v in kept.items() if s == stage.index}
        for slot, value in run(stage.backward, {**sent, **mine}):
            if slot.kind == "send":
                sent[slot.key] = value
            else:
                grads[slot.key] = grads[slot.key] + value if slot.key in grads else value
    return loss, grads


def _assert_same(whole, pipelined):
    (loss, grads), (pipe_loss, pipe_grads) = whole, pipelined
    assert torch.equal(loss, pipe_loss)
    assert grads.keys() == pipe_grads.keys()
    for fqn, grad in grads.items():
        assert torch.equal(grad, pipe_grads[fqn]), fqn


@pytest.mark.parametrize("stages", [2, 4])
def test_a_gpt_cut_into_stages_computes_the_whole_steps_loss_and_gradients(stages):
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch)
    staged = cut_stages(gm, info, blocks(4, stages))
    _assert_same(whole(gm, info, model, batch), _pipelined(staged, model, batch))
    # One tensor, the residual stream, crosses each cut each way.
    for stage in staged.stages:
        assert len(stage.forward.writes("send")) == (stage.index < stages - 1)
        assert len(stage.backward.writes("send")) == (stage.index > 0)
        assert len(stage.forward.reads(Role.RECEIVED)) == (stage.index > 0)
    # The embedding (first stage) is tied to the head (last): both hold it.
    assert staged.tied == {"transformer.wte.weight": (0, stages - 1)}
    assert staged.stages[0].params[0] == "transformer.wte.weight"
    assert "transformer.ln_f.weight" in staged.stages[-1].params
    assert "transformer.wpe.weight" in staged.stages[0].params
    assert staged.stages[-1].forward.writes("loss") == ["loss"]


def test_a_mixed_precision_step_is_cut_with_its_casts():
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch, Casts(torch.bfloat16, torch.bfloat16, torch.float32))
    staged = cut_stages(gm, info, blocks(4, 2))
    _assert_same(whole(gm, info, model, batch), _pipelined(staged, model, batch))
    # A stage's gradients are cast up where they are computed, not in another stage.
    for stage in staged.stages:
        for slot in stage.backward.outputs:
            if slot.kind == "grad":
                assert slot.dtype == torch.float32


def test_a_mixed_precision_tied_gradient_skips_the_stages_between_to_the_first():
    """Under bf16 autograd sums the head's and the embedding's parts before casting the sum
    up, in the first stage: at 4 stages the last sends the head's part to the first directly,
    past the two between, and the sum is autograd's, bit for bit."""
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch, Casts(torch.bfloat16, torch.bfloat16, torch.float32))
    staged = cut_stages(gm, info, blocks(4, 4))
    _assert_same(whole(gm, info, model, batch), _pipelined(staged, model, batch))
    peers = {s.peer for s in staged.stages[3].backward.outputs if s.kind == "send"}
    assert peers == {0, 2}
    (skipped,) = [s for s in staged.stages[0].backward.inputs if s.peer == 3]
    assert skipped.kind == Role.RECEIVED and skipped.dtype == torch.bfloat16
    assert "<- stage 0:" in staged.format()


def test_a_hugging_face_llama_recomputes_its_rotary_tables_in_each_stage():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, batch = CausalLM(), _token_batch(0, 0)
    gm, info = captured(model, batch)
    staged = cut_stages(gm, info, [["lm.model.layers.0"], ["lm.model.layers.1"]])
    _assert_same(whole(gm, info, model, batch), _pipelined(staged, model, batch))
    # Only the hidden state crosses: positions, the mask and the rotary tables depend on the
    # batch alone, and the second stage computes its own.
    (sent,) = [s for s in staged.stages[0].forward.outputs if s.kind == "send"]
    assert sent.shape == (2, 16, 32)


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_a_hugging_face_model_recomputed_in_bf16_is_cut_with_its_norms_casts(model):
    """Recompute under bf16 copies each layer's RMSNorm, whose first op casts its input (the
    residual stream the stage before computed) up to fp32, into the layer's backward: the
    copy runs with its layer, not with the stage whose value it casts (it was taken for a
    gradient's cast: PlanError 'lm.model.layers.1.input_layernorm (stage 1) reads the
    gradient _to_copy_74 of lm.model.layers.1.input_layernorm (stage 0)'). The stages compute
    the recomputed step's loss and gradients, bit for bit; the residual stream is received in
    forward and kept for the recompute, and the last stage's backward receives nothing."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    net = CausalLM() if model == "llama" else MoECausalLM("mixtral", "eager")
    batch, layer = _token_batch(0, 0), type(net.lm.model.layers[0]).__name__
    gm, info = captured(net, batch, Casts(torch.bfloat16, torch.bfloat16, torch.float32))
    plan = Plan.model_validate({"recompute": {"units": "all"}, "units": {"classes": [layer]}})
    staged = cut_step(gm, info, [["lm.model.layers.0"], ["lm.model.layers.1"]], plan, Mesh(1))
    notes = [n.meta["zerocc"].note or "" for n in gm.graph.nodes if "zerocc" in n.meta]
    assert any(note.startswith("recomputed") for note in notes)
    _assert_same(whole(gm, info, net, batch), _pipelined(staged, net, batch))
    received = staged.stages[1].forward.reads(Role.RECEIVED)
    assert set(received) & set(staged.stages[1].forward.writes("stash"))
    assert not staged.stages[1].backward.reads(Role.RECEIVED)  # (no gradient comes to the last)


@pytest.mark.parametrize("split", [False, True], ids=["backward", "zero-bubble halves"])
def test_a_recomputed_float8_step_keeps_nothing_the_passes_derive_again(split):
    """Under recompute a float8 layer's backward reads its forward's weight cast to float8
    and that cast's scale (computed from the parameter alone, kept by the recompute pass):
    the cut kept them from forward to backward, the shard pass dropped the ``keep`` (it
    derives such values again next to each use) and the backward's ``kept`` found nothing
    (issue 77's sweep: a raw KeyError '_to_copy_155' in a pipeline's first step). Each
    program that reads one now derives it again from the parameter; every ``kept`` a
    compiled stage program reads, some program of its stage keeps; the captured stages
    compute the whole step's loss and gradients bit for bit."""
    pytest.importorskip("torchao")
    model, batch = gpt(4), _gpt_batch(0, 0)
    fields = {"units": {"classes": ["Block"]}, "precision": {"matmul": "fp8"}}
    plan = Plan.model_validate({**fields, "recompute": {"units": "all"}, "grad_accumulation": 2})
    assert Float8Layers.convert(model, plan) is not None
    gm, info = captured(model, batch)
    staged = cut_step(gm, info, blocks(4, 2), plan, Mesh.of_plan(plan, 1))
    _assert_same(whole(gm, info, model, batch), _pipelined(staged, model, batch))
    for stage in staged.stages:
        held = stage_model(info, stage)
        units = assign_units(held, 1, ["Block"], [], None)
        halves = split_backward(stage.backward) if split else (stage.backward,)
        keeps, kepts = set(), set()
        for program in (stage.forward, *halves):
            ctx = PassContext(plan, Mesh.of_plan(plan, 1), held, boundary=False, units=units)
            compiled, _ = run_passes(step_form(program, held), ctx, bind_passes(plan))
            for node in compiled.graph.nodes:
                if node.target is torch.ops.zerocc.keep.default:
                    keeps.add(node.args[1])
                elif node.target is torch.ops.zerocc.kept.default:
                    kepts.add(node.args[-1])
        assert kepts and kepts <= keeps, sorted(kepts - keeps)


class _Skip(nn.Module):
    """Three layers and a skip connection from the first one's output to the last's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.layers[0](x)
        return (self.layers[2](self.layers[1](first)) + first).square().mean()


def test_a_skip_connection_over_a_stage_is_sent_to_the_stage_that_reads_it():
    """layers.0's output skips stage 1: stage 0 sends it to stage 2 directly (and to stage 1,
    which reads it too); the stages compute the whole step's loss and gradients (its two
    gradients meet in stage 1, where autograd sums them)."""
    batch = (torch.randn(4, 8),)
    model = _Skip()
    gm, info = captured(model, batch)
    staged = cut_stages(gm, info, [["layers.0"], ["layers.1"], ["layers.2"]])
    _assert_same(whole(gm, info, model, batch), _pipelined(staged, model, batch))
    sent = [(s.key, s.peer) for s in staged.stages[0].forward.outputs if s.kind == "send"]
    assert sorted(peer for _, peer in sent) == [1, 2]
    skipped = {k for k, peer in sent if peer == 2}
    assert skipped and skipped < set(staged.stages[2].forward.reads(Role.RECEIVED))


def test_units_split_out_of_their_order_are_refused():
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch)
    with pytest.raises(PlanError, match="must run one after another in the order of the split"):
        cut_stages(gm, info, [["transformer.h.2", "transformer.h.3"], blocks(4, 2)[0]])


def test_backward_derives_again_what_forward_read_of_a_parameter_instead_of_keeping_it():
    """A parameter's transpose or cast is not kept from forward to backward: stage 3 frees
    the gathered parameter after forward, and backward gathers it again."""
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch, Casts(torch.bfloat16, torch.bfloat16, torch.float32))
    of_params = {
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function" and any(i.op == "placeholder" for i in n.all_input_nodes)
        and all(i.op == "placeholder" for i in n.all_input_nodes)
    }  # fmt: skip
    for stage in cut_stages(gm, info, blocks(4, 2)).stages:
        assert not of_params & set(stage.backward.reads(Role.STASHED))
        assert not of_params & set(stage.forward.writes("stash"))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_stage_programs_compile_through_the_plans_passes_with_explicit_transfers(zero):
    """Each stage's forward and backward, in step form, through the plan's pass list on 2
    data-parallel ranks as a micro-batch that accumulates: what crosses a cut is a recv or a
    send op in the printed program, what backward reads of forward a kept op, and the
    parameters are gathered (stage 3) and the gradients reduced as in any step."""
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch)
    staged = cut_stages(gm, info, blocks(4, 2))
    plan = Plan.model_validate(
        {"zero": {"stage": zero}, "units": {"classes": ["Block"]}, "grad_accumulation": 4}
    )
    for stage in staged.stages:
        held = stage_model(info, stage)
        units = assign_units(held, 2, ["Block"], [], None)
        for program in (stage.forward, stage.backward):
            ctx = PassContext(plan, Mesh(2), held, boundary=False, units=units)
            compiled, _ = run_passes(step_form(program, held), ctx, bind_passes(plan))
            verify_program(compiled, f"stage {stage.index} {program.phase}")
            ops = count_ops(compiled.graph.nodes)
            first, last = stage.index == 0, stage.index == len(staged.stages) - 1
            forward = program.phase == "forward"
            assert ops.get("zerocc.send", 0) == (not last if forward else not first)
            assert ops.get("zerocc.recv", 0) == (not first if forward else not last)
            assert ops.get("zerocc.keep", 0) == (len(program.writes("stash")) if forward else 0)
            assert ops.get("zerocc.kept", 0) == len(program.reads(Role.STASHED))
            read = {u.name for u in units for p in u.params if p.fqn in program.reads(PARAM)}
            assert ops.get("zerocc.all_gather_start", 0) == (len(read) if zero == 3 else 0)
            reductions = ops.get("zerocc.reduce_scatter_start", 0)
            assert reductions == (0 if forward or zero < 2 else len(units))
            assert "adamw_" not in str(ops)  # a micro-batch that accumulates updates nothing
            text = format_program(compiled)
            if forward and not last:
                assert "zerocc.send(" in text and f", {stage.index + 1}, " in text


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_pipeline_ranks_update_reduces_what_its_stages_accumulated(zero):
    """The update a pipeline rank runs after its stages' backward programs: no forward or
    backward, the accumulated gradient of each unit reduced as the stage reduces it on the
    micro-batch that steps (stage 0 all-reduced, stage 1 reduce-scattered; stages 2-3 reduced
    as they accumulated), then checked and updated."""
    model, batch = gpt(4), _gpt_batch(0, 0)
    gm, info = captured(model, batch)
    stage = cut_stages(gm, info, blocks(4, 2)).stages[1]
    held = stage_model(info, stage)
    plan = Plan.model_validate(
        {"zero": {"stage": zero}, "units": {"classes": ["Block"]}, "grad_accumulation": 4}
    )
    units = assign_units(held, 2, ["Block"], [], None)
    reached = frozenset(p.fqn for p in held.trainable)
    ctx = PassContext(plan, Mesh(2), held, boundary=True, units=units, update_of=reached)
    compiled, _ = run_passes(update_graph(held, CPU, False), ctx, bind_passes(plan))
    verify_program(compiled, "update")
    ops = count_ops(compiled.graph.nodes)
    assert ops["zerocc.adamw_"] == len(units)
    reductions = {0: "zerocc.all_reduce_start", 1: "zerocc.reduce_scatter_start"}
    if zero in reductions:
        assert ops[reductions[zero]] >= len(units)
    gathers = len(units) if zero in (1, 2) else 0  # 1-2: the updated shards gathered back
    assert ops.get("zerocc.all_gather_into_start", 0) == gathers
    assert not any(op.startswith("aten.mm") for op in ops)  # no compute but the update's


def test_a_received_gradient_the_weight_gradient_reads_is_received_by_the_first_half():
    """Layer 1's weight gradient reads the gradient stage 1 sends back as it comes (a linear
    layer's last op, no op between): the input-gradient half, which runs when it arrives,
    receives it and keeps it for the weight-gradient half, which must not receive it again
    (nothing would send it twice: the rank would wait forever)."""
    batch = (torch.randn(4, 8),)
    gm, info = captured(_Skip(), batch)
    staged = cut_stages(gm, info, [["layers.0", "layers.1"], ["layers.2"]])
    input_grad, weight_grad = split_backward(staged.stages[0].backward)
    received = staged.stages[0].backward.reads(Role.RECEIVED)
    assert received and set(received) <= set(input_grad.reads(Role.RECEIVED))
    assert not weight_grad.reads(Role.RECEIVED)
    assert set(weight_grad.reads(Role.STASHED)) <= set(input_grad.writes("stash")) | set(
        staged.stages[0].forward.writes("stash")
    )
    assert weight_grad.writes("grad")
