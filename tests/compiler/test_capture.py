"""capture: one joint graph, on fake tensors, with phases and source modules tagged."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from models import build, entry, tiny_gpt
from parity import batch_of

import zerocc
from zerocc.compiler.capture import capture, default_loss_fn, describe_model
from zerocc.errors import CaptureError
from zerocc.ir.nodes import BATCH, PARAM, info, placeholders, val


def _captured(model):
    return capture(
        model, describe_model(model), None, batch_of({"model": "gpt"}, 0, 0), torch.device("cpu")
    )


def test_graph_has_params_batch_placeholders_and_returns_loss_and_grads():
    gm = _captured(tiny_gpt())
    params = placeholders(gm, PARAM)
    assert len(params) == len(describe_model(tiny_gpt()).params)
    assert [info(n).key for n in placeholders(gm, BATCH)] == ["0", "1"]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert val(outputs[0]).shape == ()
    assert [tuple(val(g).shape) for g in outputs[1:]] == [tuple(val(p).shape) for p in params]


def test_nodes_are_tagged_with_phase_and_source_module():
    gm = _captured(tiny_gpt())
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    phases = [info(n).phase for n in compute]
    assert phases == sorted(phases, key=lambda p: p == "backward")  # forward first, then backward
    assert {"forward", "backward"} == set(phases)
    modules = {info(n).module for n in compute}
    assert "transformer.h.0.attn.c_attn" in modules and "transformer.h.1.mlp.c_fc" in modules
    backward_modules = {info(n).module for n in compute if info(n).phase == "backward"}
    assert any(m.startswith("transformer.h.1") for m in backward_modules)


class _DeadWork(torch.nn.Module):
    """A block whose forward computes a value it never uses: make_fx drops those nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        unused = x.exp() * 3  # noqa: F841  (dead in the traced graph)
        return torch.relu(self.lin(x))


def test_tags_hold_where_tracing_dropped_dead_forward_nodes():
    """make_fx removes dead nodes before capture sees its graph (on a GPU, attention's unused
    outputs, say): phases and modules must not shift by the nodes it removed. Before, they were
    read off node counts taken while tracing, and the first backward nodes were tagged forward
    (a 7B GPT's recompute on an H100 then copied the loss's backward into itself)."""
    model = torch.nn.Sequential(_DeadWork(), _DeadWork(), torch.nn.Linear(4, 1))
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    gm = capture(model, describe_model(model), loss_fn, (torch.randn(2, 4),), torch.device("cpu"))
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(n.target is torch.ops.aten.exp.default for n in compute)
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0].args[0]  # detach(loss)
    after_loss = compute[compute.index(loss) + 1 :]
    assert all(info(n).phase == "forward" for n in compute[: compute.index(loss) + 1])
    assert all(info(n).phase == "backward" for n in after_loss)
    relus = [n for n in compute if n.target is torch.ops.aten.relu.default]
    assert [info(n).module for n in relus] == ["0", "1"]
    grads_of_relu = [n for n in compute if n.target is torch.ops.aten.threshold_backward.default]
    assert [info(n).module for n in grads_of_relu] == ["1", "0"]


def test_meta_model_captures_without_materializing():
    with torch.device("meta"):
        model = tiny_gpt()
    gm = _captured(model)
    assert all(
        not isinstance(val(n), torch.Tensor) or val(n).device.type == "cpu" for n in gm.graph.nodes
    )
    assert all(p.is_meta for p in model.parameters())


def test_data_dependent_control_flow_is_a_clear_error():
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            y = self.lin(x).sum()
            return y if y > 0 else -y

    model = Branchy()
    with pytest.raises(CaptureError, match="control flow on a tensor's value"):
        capture(model, describe_model(model), None, (torch.randn(2, 4),), torch.device("cpu"))


def test_an_error_in_the_model_names_its_module_and_the_models_own_lines():
    """... not torch's frames, nor zerocc's (a batch of another shape than the model's loss
    reshapes to said only "RuntimeError: shape '[504]' is invalid for input of size 512")."""

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self._flat(self.lin(x))

        def _flat(self, y):
            return y.reshape(5)  # (2, 3): 6 elements

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = Head()

        def forward(self, x):
            return self.head(x).sum()

    model = Model()
    with pytest.raises(CaptureError) as raised:
        capture(model, describe_model(model), None, (torch.randn(2, 4),), torch.device("cpu"))
    said = str(raised.value)
    assert said.startswith(
        "tracing the training step failed in module 'head': RuntimeError: shape '[5]' is "
    )
    code = said.split("where the model's code raised it (most recent call last):\n")[1]
    assert "in forward\n    return self.head(x).sum()" in code
    assert "in forward\n    return self._flat(self.lin(x))" in code
    assert code.endswith("in _flat\n    return y.reshape(5)  # (2, 3): 6 elements\n"
                         "           ^^^^^^^^^^^^")
    for package in (torch, zerocc):
        assert str(Path(package.__file__).parent) not in code


def test_default_loss_reads_the_loss_attribute_of_model_outputs():
    from dataclasses import dataclass

    @dataclass
    class Output:  # the shape of a Hugging Face ModelOutput
        loss: torch.Tensor
        logits: torch.Tensor

    class WithOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            logits = self.lin(x)
            return Output(loss=logits.pow(2).mean(), logits=logits)

    model = WithOutput()
    gm = capture(model, describe_model(model), None, (torch.randn(2, 4),), torch.device("cpu"))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert val(outputs[0]).shape == () and len(outputs) == 3


# -- placeholder names ----------------------------------------------------------------------------

# Module names and keys a model may hold, each a problem for a Python argument name: a leading
# digit (nn.Sequential), a keyword, a builtin, '-', spaces, non-ASCII letters, and two keys that
# read the same once made identifiers ('a-b' and 'a_b').
AWKWARD_NAMES = ["0.param", "if", "print", "a-b", "a_b", "with space", "é.weight", "layers.0", ""]


def _assert_valid_arguments(nodes) -> None:
    import keyword

    names = [n.name for n in nodes]
    assert len(set(names)) == len(names), names
    for node in nodes:
        assert node.name.isidentifier() and not keyword.iskeyword(node.name), node.name
        assert node.target == node.name  # fx's forward takes arguments by target, reads by name


def test_name_placeholder_makes_unique_identifiers_that_are_the_targets():
    from torch import fx

    from zerocc.ir.nodes import name_placeholder

    graph = fx.Graph()
    nodes = [name_placeholder(graph.placeholder("x"), text) for text in AWKWARD_NAMES]
    graph.output(tuple(nodes))
    _assert_valid_arguments(nodes)
    gm = fx.GraphModule(torch.nn.Module(), graph)  # compiles its generated forward
    assert gm(*range(len(nodes))) == tuple(range(len(nodes)))


def test_state_placeholders_of_awkward_keys_are_valid_arguments():
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerocc.compiler.state import StateSpec
    from zerocc.ir.nodes import PARAM_FULL, state_placeholder

    with FakeTensorMode():
        like = torch.empty(2)
    graph = fx.Graph()
    specs = [StateSpec(f"{k}.param", PARAM_FULL, k, (2,), torch.float32) for k in AWKWARD_NAMES]
    nodes = [state_placeholder(graph, spec, like) for spec in specs]
    graph.output(tuple(nodes))
    _assert_valid_arguments(nodes)
    fx.GraphModule(torch.nn.Module(), graph)


def test_captured_placeholders_of_awkward_module_names_are_valid_arguments():
    class Awkward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            keys = [k for k in AWKWARD_NAMES if k and "." not in k]  # '.' cannot be in a key
            self.blocks = torch.nn.ModuleDict({k: torch.nn.Linear(2, 2) for k in keys})
            self.seq = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))

        def forward(self, x):
            for block in self.blocks.values():
                x = block(x)
            return self.seq(x).sum()

    model = Awkward()
    gm = capture(model, describe_model(model), None, (torch.randn(2, 2),), torch.device("cpu"))
    _assert_valid_arguments(placeholders(gm))
    assert {info(n).key for n in placeholders(gm, PARAM)} == {
        name for name, _ in model.named_parameters()
    }


# -- the default loss -----------------------------------------------------------------------------


class _Returns(torch.nn.Module):
    """A model whose output is ``make(loss, logits)``: the containers models return a loss in."""

    def __init__(self, make) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.make = make

    def forward(self, x):
        logits = self.lin(x)
        return self.make(logits.pow(2).mean(), logits)


class _LossAndLogits(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class _ModelOutputLike(OrderedDict):
    """Hugging Face's ModelOutput without labels: a dict without the None fields as keys, and
    every field an attribute, None included."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__(logits=logits)
        self.loss = None
        self.logits = logits


@pytest.mark.parametrize(
    "make",
    [
        lambda loss, logits: loss,
        lambda loss, logits: {"loss": loss, "logits": logits},
        lambda loss, logits: (loss, logits),  # Hugging Face with return_dict=False
        lambda loss, logits: [loss, logits],
        _LossAndLogits,
    ],
    ids=["tensor", "dict", "tuple", "list", "namedtuple"],
)
def test_default_loss_finds_the_loss_in_each_container(make):
    model, x = _Returns(make), torch.randn(2, 4)
    expected = model.lin(x).pow(2).mean()
    assert torch.equal(default_loss_fn(model, x), expected)
    gm = capture(model, describe_model(model), None, (x,), torch.device("cpu"))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert val(outputs[0]).shape == () and len(outputs) == 3


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda loss, logits: _ModelOutputLike(logits), r"\.loss .*None.*labels.*loss_fn"),
        (lambda loss, logits: {"loss": None, "logits": logits}, r"\['loss'\].*None.*labels"),
        (lambda loss, logits: {"logits": logits, "hidden": logits}, r"keys: 'logits', 'hidden'"),
        (lambda loss, logits: (logits,), r"first element.*shape \(2, 3\).*labels.*loss_fn"),
        (lambda loss, logits: (), r"returned tuple.*holds no loss.*loss_fn"),
        (lambda loss, logits: logits, r"model's output is a tensor of shape \(2, 3\).*loss_fn"),
        (lambda loss, logits: 1.0, r"returned float.*holds no loss"),
    ],
    ids=["hf-no-labels", "dict-none", "no-loss-key", "tuple-logits", "empty", "logits", "float"],
)
def test_default_loss_says_why_an_output_holds_no_loss(make, match):
    model = _Returns(make)
    with pytest.raises(CaptureError, match=match):
        capture(model, describe_model(model), None, (torch.randn(2, 4),), torch.device("cpu"))


def test_a_loss_fn_returning_none_names_the_missing_labels():
    """A user's loss_fn of `lambda model, *batch: model(*batch).loss` on a batch without
    labels returns None: the error says that and how to pass them."""
    model = _Returns(lambda loss, logits: _ModelOutputLike(logits))
    with pytest.raises(CaptureError, match=r"returned None.*\.loss.*labels=input_ids"):
        capture(
            model,
            describe_model(model),
            lambda m, *batch: m(*batch).loss,
            (torch.randn(2, 4),),
            torch.device("cpu"),
        )


# -- the grad mode a step is traced and run in ----------------------------------------------------


def _lstm_step() -> zerocc.TrainStep:
    """An LSTM at stage 3: on CPU its forward is aten.mkldnn_rnn_layer, which returns the
    workspace its backward reads only while grad is enabled."""
    plan = {"zero": {"stage": 3}, "units": {"modules": ["rnn"]}, "seed": 7}
    return zerocc.compile(build("lstm"), plan)


def _batches() -> list[tuple[torch.Tensor, ...]]:
    return [entry("lstm")[1](i, 0) for i in range(2)]


def _trained(step, batches, mode=None) -> list[float]:
    losses = []
    for batch in batches:
        with mode() if mode else contextlib.nullcontext():
            losses.append(float(step(*batch)))
    return losses


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=lambda m: m.__name__)
def test_a_step_called_without_grad_trains_as_with_it(mode):
    """A step is traced and runs with grad enabled (the mode it was traced in), whatever the
    caller's: a training loop may call it under no_grad, and an LSTM's backward needs it."""
    expected = _trained(_lstm_step(), _batches())
    assert _trained(_lstm_step(), _batches(), mode) == expected


def test_a_batch_that_requires_grad_trains_as_one_that_does_not():
    """Running with grad enabled records no autograd graph: a batch tensor that requires grad
    is read as data, and no state tensor comes to require grad through an in-place update."""
    expected = _trained(_lstm_step(), _batches())
    step = _lstm_step()
    batches = [tuple(t.clone().requires_grad_() for t in b) for b in _batches()]
    assert _trained(step, batches) == expected
    assert not [key for key, t in step.state.items() if t.requires_grad or t.grad_fn is not None]
    assert all(b[0].grad is None for b in batches)
