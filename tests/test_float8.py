"""float8 matmuls (``precision.matmul: fp8``, issue 51 part 1): the plan's linear layers are
torchao's Float8Linear, traced into the step like any layer.

On this CPU torch's ``_scaled_mm`` multiplies the float8 values in fp32, so the numbers are a
GPU's (the same casts, scales and products) without its speed. The oracle is torchao itself:
the same model converted by ``torchao.float8.convert_to_float8_training`` with the same
recipe and layers, trained eagerly with ``torch.optim.AdamW`` on every rank's batches.

Tolerances. One rank: 1e-6 relative, as tests/parity's fp32 cases (the same ops in the same
order; measured: equal). Two ranks at stage 3: 1e-5 relative on the losses of 5 steps, as
tests/parity's multi-rank fp32 cases: the ranks' gradients are summed by a reduce-scatter,
another association of the fp32 sum, a few ulps apart, and a weight a few ulps off could round
to another float8 value in a later cast (measured: 0 tensorwise, 1.4e-7 rowwise). The same
ranks unconverted are 1e-5 to 9e-4 away from the float8 reference, step by step.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from models import _gpt_batch, tiny_gpt
from multirank import run_ranks
from torch import nn

import zerocc
from zerocc.compiler.float8 import Float8Layers
from zerocc.cost.model import node_work
from zerocc.errors import PlanError

RECIPES = ("tensorwise", "rowwise")
STEPS = 5
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}
CONVERTED = 8  # the tiny GPT's linear layers but its head: 2 blocks × (q/k/v, out, up, down)


def _plan(recipe: str, stage: int = 0, device: str = "cpu", **fp8) -> dict:
    return {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": OPTIMIZER,
        "precision": {"matmul": "fp8", "fp8": {"recipe": recipe, **fp8}},
        "backend": {"device": device, "kernels": "torch"},
    }


def _torchao(model: nn.Module, recipe: str) -> nn.Module:
    """``model`` converted by torchao alone: every linear layer but the head."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )


def _reference(recipe: str, world: int, convert: bool = True, device: str = "cpu") -> list:
    """Losses of one process training the converted model on every rank's batches."""
    torch.manual_seed(0)
    model = tiny_gpt()
    model = (_torchao(model, recipe) if convert else model).to(device)
    settings = {k: v for k, v in OPTIMIZER.items() if k != "name"}
    opt = torch.optim.AdamW(model.parameters(), **settings)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        per_rank = [model(*(t.to(device) for t in _gpt_batch(i, r))) for r in range(world)]
        total = sum(per_rank) / world
        total.backward()
        opt.step()
        losses.append([float(x) for x in per_rank])
    return losses


def _train(rank: int, world: int, recipe: str, stage: int, device: str = "cpu") -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    step = zerocc.compile(tiny_gpt(), _plan(recipe, stage, device))
    losses = [float(step(*(t.to(device) for t in _gpt_batch(i, rank)))) for i in range(STEPS)]
    scaled = [n for n in step.program.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    timed = {(node_work(n).dtype, node_work(n).flops > 0) for n in scaled}
    return {"losses": losses, "scaled_mm": len(scaled), "timed": timed, "explain": step.explain()}


@functools.cache
def _one_rank(recipe: str) -> dict:
    return _train(0, 1, recipe, 0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_rank_trains_as_torchao_does(recipe):
    ours = _one_rank(recipe)["losses"]
    assert ours == pytest.approx([r[0] for r in _reference(recipe, 1)], rel=1e-6)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_converted_layer_multiplies_in_float8_forward_and_backward(recipe):
    """Three float8 matmuls per layer: its output, its input's gradient, its weight's, each
    timed by the cost model at the device's float8 rate."""
    run = _one_rank(recipe)
    assert run["scaled_mm"] == 3 * CONVERTED
    assert run["timed"] == {("fp8", True)}
    said = next(line for line in run["explain"].splitlines() if "float8 matmuls" in line)
    assert f"({recipe}, torchao's Float8Linear), emulated on the CPU" in said
    assert f"{CONVERTED} layers" in said and "lm_head (the output head)" in said


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_at_stage_3_train_as_torchao_on_both_batches(recipe):
    ranks = run_ranks(2, _train, recipe, 3)
    reference = _reference(recipe, 2)
    unconverted = _reference(recipe, 2, convert=False)
    for rank, run in enumerate(ranks):
        want = [r[rank] for r in reference]
        assert run["losses"] == pytest.approx(want, rel=1e-5)
        assert run["losses"] != pytest.approx([r[rank] for r in unconverted], rel=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_on_a_gpu_the_float8_kernels_train_as_torchao_does(recipe):
    """On a GPU with float8 matmuls (H100, H200, L4: compute capability 8.9 and on)
    ``_scaled_mm`` is cuBLAS's float8 GEMM: one rank trains as torchao does on the same GPU,
    to 1e-5 (the same kernels on the same operands; the eager backend's elementwise ops and
    torch's are the same kernels too), and three float8 matmuls run per layer."""
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no float8 matmuls (8.9 and on)")
    run = _train(0, 1, recipe, 0, "cuda")
    assert run["losses"] == pytest.approx([r[0] for r in _reference(recipe, 1, device="cuda")],
                                          rel=1e-5)  # fmt: skip
    assert run["scaled_mm"] == 3 * CONVERTED
    assert "emulated" not in run["explain"]


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.mid, self.head = nn.Linear(16, 32), nn.Linear(32, 10), nn.Linear(10, 16)


def test_the_default_leaves_the_head_and_layers_float8_cannot_take():
    layers = Float8Layers.convert(_Odd(), zerocc.load_plan(_plan("tensorwise")))
    assert layers.layers == ("up",)
    assert dict(layers.kept) == {
        "head": "the output head",
        "mid": "32 -> 10 features, not multiples of 16 (the float8 kernels need them)",
    }


def test_layers_tensor_parallelism_splits_stay_in_the_compute_dtype():
    plan = _plan("tensorwise")
    plan["parallel"] = {"tp": 2, "tp_layers": {"mid": "colwise", "up": "rowwise"}}
    with pytest.raises(PlanError, match="up: split by parallel.tp"):
        Float8Layers.convert(_Odd(), zerocc.load_plan(plan))  # (nothing left to convert)
    plan["parallel"]["tp_layers"] = {"mid": "colwise"}
    model = _Odd()
    model.mid = nn.Linear(32, 16)
    layers = Float8Layers.convert(model, zerocc.load_plan(plan))
    assert layers.layers == ("up",)
    assert dict(layers.kept)["mid"].startswith("split by parallel.tp")


@pytest.mark.parametrize(
    ("layers", "said"),
    [
        (["nothing.*"], "'nothing.*' matches no nn.Linear; the model's are: up, mid, head"),
        (["mid"], "mid is 32 -> 10 features, not multiples of 16"),
    ],
)
def test_a_glob_it_cannot_follow_is_an_error(layers, said):
    with pytest.raises(PlanError, match=said):
        Float8Layers.convert(_Odd(), zerocc.load_plan(_plan("tensorwise", layers=layers)))


def test_a_model_converted_under_another_recipe_is_an_error():
    model = _torchao(tiny_gpt(), "rowwise")
    with pytest.raises(PlanError, match="converted already, under another recipe"):
        up = ["transformer.h.*.mlp.c_fc"]
        Float8Layers.convert(model, zerocc.load_plan(_plan("tensorwise", layers=up)))
    same = Float8Layers.convert(model, zerocc.load_plan(_plan("rowwise")))  # (a later session)
    assert len(same.layers) == CONVERTED


def test_a_meta_model_keeps_its_layers_own_initialization():
    """The example GPT's Linear initializes as nanoGPT does; converted, it still does."""
    with torch.device("meta"):
        plain, converted = tiny_gpt(), tiny_gpt()
    Float8Layers.convert(converted, zerocc.load_plan(_plan("tensorwise")))
    zerocc.materialize(plain, seed=3)
    zerocc.materialize(converted, seed=3)
    pairs = zip(plain.named_parameters(), converted.named_parameters(), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), name


def test_a_gpu_without_float8_matmuls_is_named_with_what_would_work(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    layers = Float8Layers("tensorwise", ("up",), ())
    with pytest.raises(PlanError, match=r"A100-SXM4-80GB, compute capability 8\.0.*H100"):
        layers.check_device(torch.device("cuda", 0))
    layers.check_device(torch.device("cpu"))  # (emulated, said in explain())


def test_without_torchao_the_plan_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(PlanError, match=r"pip install 'zerocc\[fp8\]'"):
        Float8Layers.convert(_Odd(), zerocc.load_plan(_plan("tensorwise")))


def test_a_plan_without_fp8_converts_nothing():
    model = _Odd()
    before = copy.deepcopy(model)
    assert Float8Layers.convert(model, zerocc.load_plan({})) is None
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
