"""16-bit rounding under the Inductor backend (zerocc/backends/inductor/eager_casts.py): a value
cast to bf16 or fp16 is rounded where eager rounds it, on every torch release.

Torch 2.13's Inductor keeps that rounding under ``emulate_precision_casts``; before 2.13 it
dropped it in two places, which ``rounding_as_eager`` mends. Each numeric case runs with the
mend as this torch needs it ("native": on 2.13 it does nothing) and forced on ("mended": what
a release before 2.13 runs, here on this one), and must equal eager to the bit: a cast and an
elementwise product are exact operations, so no reordering excuses a difference.
"""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt
from torch._inductor import config
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.proxy_tensor import make_fx

import zerocc
from zerocc.backends.inductor import eager_casts
from zerocc.backends.inductor.eager_casts import MARKER, MENDED, rounding_as_eager


@pytest.fixture(params=["native", "mended"])
def mend(request, monkeypatch):
    if request.param == "mended":
        monkeypatch.setattr(eager_casts, "torch_drops_rounding", lambda: True)
    return request.param


def _rounded(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    through_bf16 = (x * 3.3).to(torch.bfloat16).float() * 1.7
    seeded = scale.to(torch.float16) * x.to(torch.float16)  # 65536 is fp16's infinity
    return through_bf16, seeded


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_narrowing_cast_rounds_as_eager_does(mend, device):
    """C++ kernels on the CPU, Triton's on a GPU (the joint-graph pattern is both's)."""
    x = torch.randn(67, device=device)  # 67: vector lanes and a scalar tail
    scale = torch.tensor(65536.0, device=device)
    graph = make_fx(_rounded)(x, scale)
    with config.patch(emulate_precision_casts=True), rounding_as_eager():
        compiled = compile_fx(graph, [x, scale])
    eager = _rounded(x, scale)
    for ours, theirs in zip(compiled(x, scale), eager, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.isinf(eager[1]).all()  # the seeded product overflows in eager: so in ours


def test_the_mend_keys_inductors_cache_apart_and_runs_a_users_own_pass(monkeypatch):
    monkeypatch.setattr(eager_casts, "torch_drops_rounding", lambda: True)
    seen = []

    class UsersPass(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "the user's"

    with rounding_as_eager():
        assert config.joint_custom_pre_pass.uuid() == (MARKER, None)
    with config.patch(joint_custom_pre_pass=UsersPass()), rounding_as_eager():
        marker = config.joint_custom_pre_pass
        assert marker.uuid() == (MARKER, "the user's")
        marker(torch.fx.Graph())
    assert len(seen) == 1 and config.joint_custom_pre_pass is None  # restored after


def _first_step(backend: str) -> tuple[list[str], float | None, int]:
    torch.manual_seed(0)
    plan = {
        "zero": {"stage": 0},
        "units": {"classes": ["Block"]},
        "precision": {"param": "fp16", "dynamic": {"hysteresis": 1}},  # scaled from 65536
        "backend": {"name": backend, "device": "cpu"},
    }
    step = zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(world_size=1))
    step(*_gpt_batch(0, 0))
    return step.record().backend_notes, step.loss_scale, step.skipped_steps


@pytest.mark.parametrize("backend", ["inductor-whole", "inductor"])
def test_fp16_gradients_seeded_with_65536_overflow_as_eagers_do(mend, backend):
    """Backward is seeded with the loss scale cast to fp16: 65536 is an infinity there, so
    eager's first step overflows, is skipped and halves the scale; so must the compiled one
    (torch 2.11's Inductor, unmended, kept the seed in fp32 and took the step)."""
    eager = _first_step("eager")
    assert eager[1:] == (32768.0, 1)
    notes, *compiled = _first_step(backend)
    assert compiled == list(eager[1:])
    assert (MENDED in notes) == eager_casts.torch_drops_rounding(), notes  # explain() says so
