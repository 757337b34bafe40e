"""Repeated layers (zerocc.compiler.repeats): a module whose instances run alike is traced once.

The graph must be the one tracing every call gives: the same ops, in the same order, on the
same arguments, tagged with the same phase and module, with fake values of the same shape,
strides, dtype and device that share memory as the traced ones do (the memory estimate reads
that). Each case captures a model both ways and compares the two node by node; the cases a
template must refuse are traced call by call, and say why.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
from models import _gpt_batch, numbered, tiny_gpt, tiny_gpt_4_layers, tiny_gpt_dropout
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from zerocc.compiler.capture import Casts, capture, describe_model
from zerocc.compiler.twins import candidates
from zerocc.ir.nodes import info

CPU = torch.device("cpu")
BF16 = Casts(torch.bfloat16, None, torch.float32, loss_scale=True)


def _signature(gm: fx.GraphModule) -> list[tuple]:
    """Every node as the passes see it: op, target, arguments (as node positions), phase,
    module, and its value's metadata with the first node whose value shares its memory."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner: dict[StorageWeakRef, int] = {}

    def value(v):
        if isinstance(v, torch.Tensor):
            shared = owner.setdefault(StorageWeakRef(v.untyped_storage()), len(owner))
            return (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device,
                    shared)  # fmt: skip
        if isinstance(v, (tuple, list)):
            return tuple(value(x) for x in v)
        return v

    def arg(a):
        if isinstance(a, str):  # an opaque region's key: its FQN and a serial of the process
            return re.sub(r"#\d+$", "", a)
        return ("node", position[a]) if isinstance(a, fx.Node) else a

    out = []
    for n in gm.graph.nodes:
        record = info(n)
        args = fx.node.map_aggregate(n.args, arg)
        kwargs = fx.node.map_aggregate(n.kwargs, arg)
        out.append((n.op, str(n.target), args, kwargs, record.phase, record.module, record.role,
                    value(n.meta.get("val"))))  # fmt: skip
    return out


def _both(model: nn.Module, batch, casts: Casts | None = None, gradients: bool = True):
    """The model captured call by call, then with repeated layers copied. (After a first
    capture: torch's fake-tensor cache makes the first capture of an LSTM differ from later
    ones, which would hide what this compares.)"""
    model_info = describe_model(model)
    graphs = [
        capture(model, model_info, None, batch, CPU, casts, gradients, repeated_layers=rep)
        for rep in (False, False, True)
    ]
    return graphs[1:]


def _alike(model: nn.Module, batch, casts: Casts | None = None, gradients: bool = True) -> str:
    """The model captured both ways (:func:`_both`), held to one graph; what the copying
    capture says it copied."""
    traced, copied = _both(model, batch, casts, gradients)
    _assert_same_graph(traced, copied)
    assert traced.meta["repeated_layers"] == ""
    return copied.meta["repeated_layers"]


def _assert_same_graph(traced: fx.GraphModule, copied: fx.GraphModule) -> None:
    a, b = _signature(traced), _signature(copied)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == y, f"node {i} differs:\n traced {x}\n copied {y}"


@pytest.mark.parametrize("casts", [None, BF16], ids=["fp32", "bf16-loss-scale"])
@pytest.mark.parametrize("make", [tiny_gpt_4_layers, tiny_gpt_dropout], ids=["gpt", "dropout"])
def test_the_copied_graph_is_the_traced_one(make, casts):
    torch.manual_seed(0)
    model = make()
    assert _alike(model, _gpt_batch(0, 0), casts) == (
        f"{len(model.transformer.h)} Block calls traced once (on transformer.h.0)"
    )


def test_the_forward_only_capture_copies_too():
    assert "traced once" in _alike(tiny_gpt(), _gpt_batch(0, 0), gradients=False)


@pytest.mark.parametrize("name", ["numbered", "llama", "mixtral", "lstm_deep"])
def test_other_models_capture_alike(name):
    """Small repeated modules (linears of a Sequential), a Hugging Face Llama, a mixture of
    experts (opaque regions inside the blocks: refused), a deep LSTM (no layers)."""
    model, batch_of, _ = _entry(name)
    torch.manual_seed(0)
    _alike(model, batch_of(0, 0))


def test_a_layer_called_twice_sums_its_gradients_later():
    """``shared.0`` runs twice (and ``middle.0`` is its twin): its weight's two gradients are
    summed once each copy's backward is done, where tracing call by call sums them as soon as
    autograd has both. The same ops, another order; the same numbers (two terms)."""
    model, batch_of, _ = _entry("twice")
    batch = batch_of(0, 0)
    traced, copied = _both(model, batch)
    assert copied.meta["repeated_layers"] == (  # (the first call's input takes no gradient)
        "1 Linear calls traced once (on shared.0); 2 Linear calls traced once (on middle.0)"
    )
    a, b = _signature(traced), _signature(copied)
    assert a != b  # reordered
    assert collections.Counter(x[1] for x in a) == collections.Counter(x[1] for x in b)
    for gm in (traced, copied):
        _check_numbers(model, gm, batch)


def _entry(name):
    from models import entry

    make, batch_of, options = entry(name)
    torch.manual_seed(0)
    return make(), batch_of, options


def test_numbered_linears_are_copies():
    model = numbered()
    assert sorted(candidates(model)) == ["2", "3.0"]  # (8 → 8 each; "0" is 6 → 8)


def test_hugging_face_llama_layers_are_twins_whose_trace_reads_no_layer_idx():
    """A decoder layer holds its ``layer_idx``: a scalar, which a fingerprint holds by name, and
    a template by the values its trace read (attention reads it for a KV cache, which training
    does not pass)."""
    model, batch_of, _ = _entry("llama")
    assert sorted(candidates(model)) == ["lm.model.layers.0", "lm.model.layers.1"]
    assert _alike(model, batch_of(0, 0)) == (  # (use_cache: each layer writes the cache)
        "LlamaDecoderLayer traced per call (an argument is neither a tensor nor a plain "
        "value: DynamicCache)"
    )
    model.lm.config.use_cache = False
    assert _alike(model, batch_of(0, 0)) == (
        "2 LlamaDecoderLayer calls traced once (on lm.model.layers.0)"
    )


class _ReadsIndex(nn.Module):
    """A block whose forward reads its index: odd ones add a tanh."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin, self.index = nn.Linear(8, 8), index

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        return torch.tanh(h) if self.index % 2 else h


def test_a_scalar_the_trace_reads_takes_a_template_per_value():
    """(Per value read: that only its parity matters is not known.)"""

    class Net(_Net):
        def __init__(self) -> None:
            super().__init__(_Plain)
            self.blocks = nn.ModuleList(_ReadsIndex(i) for i in range(4))

    assert _alike(Net(), _IDS) == "; ".join(
        f"1 _ReadsIndex calls traced once (on blocks.{i})" for i in range(4)
    )


# -- what a template refuses, and what never is one ----------------------------------------------


class _Net(nn.Module):
    """Embedding, three blocks of ``block``, a loss."""

    def __init__(self, block: type[nn.Module], n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return h.pow(2).mean()


class _WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        calls.add_(1)
        return torch.tanh(self.lin(h))


class _Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(h))


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, scale: object = None) -> torch.Tensor:
        return torch.tanh(self.lin(h))


_IDS = (torch.arange(12).reshape(3, 4) % 16,)


class _Rotate(nn.Module):
    """A function as a module with no state, as Hugging Face's ``kernels`` wraps one."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.roll(1, dims=-1)


class _HoldsItsFunction(_Plain):
    """A block holding its own instance of ``_Rotate`` outside its submodules (what
    ``kernels.use_kernelized_func`` gives a Llama attention: ``_kernel_funcs``)."""

    def __init__(self) -> None:
        super().__init__()
        self._funcs = {"rotate": _Rotate()}

    def forward(self, h: torch.Tensor, scale: object = None) -> torch.Tensor:
        return self._funcs["rotate"](super().forward(h))


def test_blocks_holding_their_own_stateless_module_are_twins():
    assert _alike(_Net(_HoldsItsFunction), _IDS) == (
        "3 _HoldsItsFunction calls traced once (on blocks.0)"
    )


def test_blocks_holding_their_own_module_with_a_parameter_are_not():
    """(Its parameter is not the model's: each block's would be read as the template's.)"""
    model = _Net(_HoldsItsFunction)
    for block in model.blocks:
        block._funcs["rotate"].scale = nn.Parameter(torch.ones(()))
    assert candidates(model) == {}


def test_a_block_changing_its_attributes_is_traced_per_call():
    model = _Net(_Counts)
    assert _alike(model, _IDS) == (
        "_Counts traced per call (tracing its forward changed its attributes)"
    )


def test_a_block_writing_into_its_input_is_traced_per_call():
    class Net(_Net):
        def forward(self, ids):
            h, calls = self.embed(ids), torch.zeros((), device=ids.device)
            for b in self.blocks:
                h = b(h, calls)
            return h.pow(2).mean() + calls

    assert _alike(Net(_WritesInput), _IDS) == (
        "_WritesInput traced per call (its forward or backward writes into an input)"
    )


def test_an_argument_that_is_no_plain_value_is_traced_per_call():
    class Net(_Net):
        def forward(self, ids):
            h = self.embed(ids)
            for b in self.blocks:
                h = b(h, scale=object())
            return h.pow(2).mean()

    assert _alike(Net(_Plain), _IDS) == (
        "_Plain traced per call (an argument is neither a tensor nor a plain value: object)"
    )


def test_blocks_that_differ_hooked_or_sharing_a_module_are_no_candidates():
    differ = _Net(_Plain)
    differ.blocks[0].act, differ.blocks[1].act = torch.tanh, torch.sigmoid  # (objects)
    differ.blocks[2].act = torch.relu
    assert sorted(candidates(differ)) == []
    lacks = _Net(_Plain)
    lacks.blocks[1].index, lacks.blocks[2].index = 1, 2  # (scalars: held by name)
    assert sorted(candidates(lacks)) == ["blocks.1", "blocks.2"]

    hooked = _Net(_Plain)
    hooked.blocks[0].register_forward_hook(lambda *args: None)
    assert sorted(candidates(hooked)) == ["blocks.1", "blocks.2"]

    shared = _Net(_Plain)
    shared.blocks[1].lin = shared.blocks[0].lin
    assert sorted(candidates(shared)) == []  # (blocks.2 has no twin left)

    frozen = _Net(_Plain)
    frozen.blocks[0].lin.weight.requires_grad_(False)
    assert sorted(candidates(frozen)) == ["blocks.1", "blocks.2"]


class _KeepsOutputs(_Net):
    """Blocks whose linears' outputs the loss reads through hooks the forward registers on its
    first call, as transformers' output capturing keeps a mixture of experts' router logits
    for the load-balancing loss (issue 77: ``zerocc train examples/huggingface/mixtral-tiny.yaml
    --set parallel.ep=2``, and the example with grouped_mm experts, failed in their first step
    on a fake tensor the template's trace had kept)."""

    def __init__(self) -> None:
        super().__init__(_Plain)
        self.hooked, self.kept = False, []

    def _keep(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.kept.append(output)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.hooked = True
            for block in self.blocks:
                block.lin.register_forward_hook(self._keep)
        self.kept = []
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return h.pow(2).mean() + sum(k.mean() for k in self.kept) / len(self.kept)


def test_a_hook_the_forward_registers_makes_its_layers_traced_per_call():
    torch.manual_seed(0)
    model = _KeepsOutputs()
    gm = capture(model, describe_model(model), None, _IDS, CPU)
    assert gm.meta["repeated_layers"] == (
        "_Plain traced per call (the model's forward registered a hook in it)"
    )
    assert [n for n in gm.graph.nodes if n.op == "get_attr"] == []
    _check_numbers(model, gm)  # (each block's output read once, through its own call)


def test_a_tensor_another_trace_kept_is_a_capture_error(monkeypatch):
    """Were a template traced with such a hook, the tensor it keeps is the template trace's:
    no value of the step, said when the step is captured (it failed in the program's first
    run, in the first op reading it, with torch's "Please convert all Tensors to
    FakeTensors")."""
    from zerocc.compiler import repeats
    from zerocc.errors import CaptureError

    monkeypatch.setattr(repeats, "hook_ids", lambda module: frozenset())
    model = _KeepsOutputs()
    with pytest.raises(CaptureError, match=r"the model's forward or loss reads a tensor of "
                       r"shape \(3, 4, 8\) that the traced step did not compute"):  # fmt: skip
        capture(model, describe_model(model), None, _IDS, CPU)


def test_calls_of_another_shape_get_a_template_of_their_own():
    class Net(_Net):
        def forward(self, ids):
            h = self.embed(ids)
            h = self.blocks[0](h)
            h = self.blocks[1](h[:, :2].contiguous())  # a shorter sequence
            return self.blocks[2](h).pow(2).mean()

    assert _alike(Net(_Plain), _IDS) == (
        "1 _Plain calls traced once (on blocks.0); 2 _Plain calls traced once (on blocks.1)"
    )


def test_a_view_at_an_offset_is_traced_per_call():
    class Net(_Net):
        def forward(self, ids):
            h = self.embed(ids)
            for b in self.blocks:
                h = b(h[:, 1:])  # (a view at an offset, each call shorter)
            return h.pow(2).mean()

    assert _alike(Net(_Plain), _IDS) == "_Plain traced per call (an input is a view at an offset)"


def test_a_gradient_in_another_layout_is_copied_into_the_traced_one():
    """A block whose output's gradient arrives transposed: the copy's backward reads it in the
    layout its template was traced with (a copy), and computes the same gradients."""

    class Net(_Net):
        def forward(self, ids):
            h = self.embed(ids)
            for b in self.blocks:
                h = b(h)
            return h.transpose(0, 1).contiguous().pow(2).mean()

    model = Net(_Plain)
    model_info = describe_model(model)
    copied = capture(model, model_info, None, _IDS, CPU)
    assert "3 _Plain calls traced once" in copied.meta["repeated_layers"]
    _check_numbers(model, copied)


def _check_numbers(model: nn.Module, gm: fx.GraphModule, batch=_IDS) -> None:
    """The captured graph, run on the model's weights, gives eager autograd's loss and
    gradients, to the bit (the same ops, each gradient's terms summed in the same order)."""
    params = [p for _, p in model.named_parameters()]
    loss = model(*batch)
    expected = torch.autograd.grad(loss, params)
    outputs = gm(*[p.detach() for p in params], *[b.detach() for b in model.buffers()], *batch)
    assert torch.equal(outputs[0], loss.detach())
    for got, want in zip(outputs[1:], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_copies_compute_what_eager_autograd_does():
    torch.manual_seed(0)
    model = _Net(_Plain)
    gm = capture(model, describe_model(model), None, _IDS, CPU)
    assert "3 _Plain calls traced once" in gm.meta["repeated_layers"]
    _check_numbers(model, gm)


@pytest.mark.parametrize("precision", [{}, {"param": "bf16"}], ids=["fp32", "bf16"])
def test_training_with_copies_is_training_without_them(precision):
    """`capture.repeated_layers` on (the default) and off train the 4-block GPT alike, step by
    step, to the bit: the program is the same."""
    import zerocc

    losses = {}
    for repeated in (True, False):
        plan = {
            "zero": {"stage": 3},
            "units": {"classes": ["Block"]},
            "precision": precision,
            "capture": {"repeated_layers": repeated},
        }
        torch.manual_seed(0)
        step = zerocc.compile(tiny_gpt_4_layers(), plan)
        losses[repeated] = [step(*_gpt_batch(i, 0)).item() for i in range(3)]
        (program,) = step.programs.values()
        header = program.records[0].header
        assert ("4 Block calls traced once (on transformer.h.0)" in header) == repeated
    assert losses[True] == losses[False]


@pytest.mark.parametrize("precision", [{}, {"param": "bf16"}], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_tensor_parallel_blocks_are_copies_too(sequence_parallel, precision):
    """Split layers (their forwards put in place per layer, their collectives' notes naming the
    layer) and sequence parallelism's gathers (hooks) and chunks (what it knows of each tensor,
    given to each template's inputs and each copy's outputs): the copies are the traced
    graph. Under sequence parallelism the first block reads the whole sequence and the others
    chunks: two templates."""
    from models import GPT, GPT_TP_LAYERS, GPTConfig

    from zerocc.compiler.parallel.collectives import NOTE
    from zerocc.compiler.parallel.tensor_parallel import TensorParallel
    from zerocc.compiler.plan import load_plan

    parallel = {"tp": 2, "tp_layers": GPT_TP_LAYERS, "sequence_parallel": sequence_parallel}
    plan = load_plan({"parallel": parallel, "precision": precision})
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=4, n_embd=16))
    full = describe_model(model)
    tp = TensorParallel.of(model, full, plan)

    def captured(repeated: bool) -> fx.GraphModule:
        with tp.applied(model):
            return capture(model, tp.local_info(full), None, _gpt_batch(0, 0), CPU,
                           Casts.of(plan.precision), loss_check=tp.check_loss,
                           repeated_layers=repeated, tensor_status=tp.tensor_status())  # fmt: skip

    captured(False)  # (see _both)
    traced, copied = captured(False), captured(True)
    _assert_same_graph(traced, copied)
    expected = (
        "1 Block calls traced once (on transformer.h.0); 2 Block calls traced once (on "
        "transformer.h.1)"
        if sequence_parallel
        else "3 Block calls traced once (on transformer.h.0)"
    )
    assert copied.meta["repeated_layers"] == expected
    notes = [n.meta.get("custom", {}).get(NOTE, "") for n in copied.graph.nodes]
    assert any("transformer.h.2.attn.c_proj" in note for note in notes)  # (renamed, not h.0's)
    assert notes == [n.meta.get("custom", {}).get(NOTE, "") for n in traced.graph.nodes]
