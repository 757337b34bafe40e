"""capture: one joint graph, on fake tensors, with phases and source modules tagged."""

from __future__ import annotations

import torch
from models import tiny_gpt
from parity import batch_of

from zerocc.capture import capture, describe_model
from zerocc.ir import BATCH, PARAM, info, placeholders, val


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


def test_meta_model_captures_without_materializing():
    with torch.device("meta"):
        model = tiny_gpt()
    gm = _captured(model)
    assert all(
        not isinstance(val(n), torch.Tensor) or val(n).device.type == "cpu" for n in gm.graph.nodes
    )
    assert all(p.is_meta for p in model.parameters())


def test_data_dependent_control_flow_is_a_clear_error():
    import pytest

    from zerocc.errors import CaptureError

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
