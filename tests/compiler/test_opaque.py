"""Capture of steps whose shapes depend on the data (issue 48, part 1): a submodule that
cannot be traced on fake tensors becomes an opaque region, one op whose backward recomputes
it; what still cannot be captured is a CaptureError naming the op and the module; torch's
grouped matmul captures in fp32 on the CPU. One process: the 2-rank parity of real
mixture-of-experts models is tests/parity/test_moe_parity.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import zerocc
from zerocc.compiler.capture import capture, describe_model
from zerocc.compiler.opaque import regions_in
from zerocc.errors import CaptureError, NonFiniteError
from zerocc.ir.nodes import info, op_name

TOKENS, WIDTH, EXPERTS = 6, 8, 4


class LoopedExperts(nn.Module):
    """Experts as transformers' ``eager`` implementation runs them: the experts hit found with
    ``nonzero``, a Python loop over them, each one's tokens found with ``where``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        hit = torch.bincount(idx.flatten(), minlength=EXPERTS).nonzero()
        for e in hit:
            token, slot = torch.where(idx == e[0])
            out.index_add_(0, token, (x[token] @ self.w[e[0]]) * weight[token, slot, None])
        return out


class Routed(nn.Module):
    """A router (top-2 of a softmax) before the experts; the loss reads every output."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = LoopedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, idx = self.router(x).softmax(-1).topk(2, -1)
        return self.experts(x, idx, weight).pow(2).mean()


def _model() -> Routed:
    torch.manual_seed(0)
    return Routed()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(step))


def test_a_data_dependent_submodule_is_one_op_and_its_gradients_are_autograds():
    model, x = _model(), _batch(0)
    gm = capture(model, describe_model(model), None, (x,), torch.device("cpu"))
    ops = [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count("zerocc_opaque.region_forward") == 1
    assert ops.count("zerocc_opaque.region_backward") == 1
    assert "aten.nonzero" not in ops  # (inside the region)
    (region,) = regions_in(gm)
    assert (region.fqn, region.kind) == ("experts", "LoopedExperts")
    assert "aten.bincount" in region.reason  # (the first op whose result depends on the data)
    backward = next(n for n in gm.graph.nodes if op_name(n.target).endswith("region_backward"))
    assert (info(backward).phase, info(backward).module) == ("backward", "experts")

    params = list(model.parameters())
    loss, *grads = gm(*params, x)
    expected = torch.autograd.grad(model(x), params)
    assert float(loss) == pytest.approx(float(model(x).detach()), rel=1e-6)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_region_that_draws_random_numbers_draws_them_again_in_its_backward():
    """Dropout inside the region: its recompute in backward sets the generator to where the
    forward found it, so the gradients are those of the masks the forward drew."""

    class DroppedExperts(LoopedExperts):
        def forward(self, x, idx, weight):
            return nn.functional.dropout(super().forward(x, idx, weight), 0.5)

    model, x = _model(), _batch(0)
    model.experts = DroppedExperts()
    gm = capture(model, describe_model(model), None, (x,), torch.device("cpu"))
    params = list(model.parameters())
    torch.manual_seed(1)
    loss, *grads = gm(*params, x)
    after = torch.rand(1)
    torch.manual_seed(1)
    expected_loss = model(x)
    expected = torch.autograd.grad(expected_loss, params)
    assert float(loss) == float(expected_loss.detach())
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(after, torch.rand(1))  # the generator then goes on as eager's did


def test_a_step_with_opaque_regions_trains_as_eager_training_does_and_says_so():
    model = _model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    step = zerocc.compile(model, {"optimizer": {"name": "sgd", "lr": 0.5},
                                  "units": {"modules": ["experts"]}})  # fmt: skip
    for s in range(3):
        loss = step(_batch(s))
        expected = reference(_batch(s))
        opt.zero_grad()
        expected.backward()
        opt.step()
        assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert "opaque regions: LoopedExperts ×1 (aten.bincount" in step.explain()


def test_the_registry_of_regions_does_not_keep_a_dropped_model_alive():
    """The op finds a region by key in a registry that holds its module weakly: a model
    dropped (plan auto compiles a step per candidate) is freed, and its program can still be
    inspected."""
    import gc
    import weakref

    model, x = _model(), _batch(0)
    gm = capture(model, describe_model(model), None, (x,), torch.device("cpu"))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    (region,) = regions_in(gm)
    assert region.kind == "LoopedExperts"
    with pytest.raises(RuntimeError, match="the model of its step is gone"):
        _ = region.module


def test_data_dependence_in_the_model_itself_names_the_op_and_the_way_out():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.w(x)
            return y[y > 0].sum()

    with pytest.raises(CaptureError) as caught:
        zerocc.compile(Masked(), {"optimizer": {"name": "sgd", "lr": 0.1}})(_batch(0))
    message = str(caught.value)
    assert "in the model's forward or loss" in message
    assert "aten.nonzero" in message or "aten.masked_select" in message
    assert "torch.where(mask, x, 0)" in message


def test_a_region_whose_output_shape_depends_on_the_data_is_refused_when_it_runs():
    class Positive(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(WIDTH, WIDTH)
            self.keep = Positive()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.keep(self.w(x)).sum()

    step = zerocc.compile(Model(), {"optimizer": {"name": "sgd", "lr": 0.1}})
    with pytest.raises(CaptureError, match=r"keep \(Positive\), an opaque region .* returned"):
        step(_batch(0))


def test_capture_errors_print_no_fake_tensor_traceback(caplog):
    caplog.set_level(logging.DEBUG, logger="torch._subclasses.fake_tensor")

    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(WIDTH, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w(x) @ self.w(x)  # (6, 3) @ (6, 3): no such matmul

    with pytest.raises(CaptureError, match="tracing the training step failed"):
        zerocc.compile(Bad(), {"optimizer": {"name": "sgd", "lr": 0.1}})(_batch(0))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class GroupedExperts(nn.Module):
    """Experts as transformers' ``grouped_mm`` implementation runs them: tokens sorted by
    expert, one grouped matmul over the offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.w = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        weight, idx = self.router(x).softmax(-1).max(-1)
        order = idx.argsort()
        counts = torch.histc(idx.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        y = torch._grouped_mm(x[order], self.w, offs=offsets) * weight[order, None]
        return y.pow(2).mean()


def test_grouped_matmul_captures_in_fp32_on_the_cpu_as_one_op():
    torch.manual_seed(0)
    model = GroupedExperts()
    x = _batch(0)
    gm = capture(model, describe_model(model), None, (x,), torch.device("cpu"))
    ops = [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count("aten._grouped_mm") == 3  # forward, and backward's two (input, weights)
    assert not regions_in(gm)
    params = list(model.parameters())
    loss, *grads = gm(*params, x)
    for got, want in zip(grads, torch.autograd.grad(model(x), params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_non_finite_router_is_named_like_any_other_gradient():
    model = _model()
    with torch.no_grad():
        model.router.weight[0, 0] = float("nan")
    step = zerocc.compile(model, {"optimizer": {"name": "sgd", "lr": 0.1},
                                  "units": {"modules": ["router", "experts"]}})  # fmt: skip
    with pytest.raises(NonFiniteError, match="holds an inf or NaN.*'router'"):
        step(_batch(0))
