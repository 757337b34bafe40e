"""Compiling once per repeated layer (zerocc/backends/inductor/region_keys.py, regions.py): by
region, a layer's compute is regions of its own, and regions of one key (the copies of a layer)
run one compiled graph, so the number of graphs Inductor compiles does not grow with depth.

Counted two ways: the calls into ``compile_fx`` (patched to count) and the executable's own
counter (``InductorExecutable.compilations``), on the tiny GPT (16 wide, 8 tokens) at 2 and 8
layers, two simulated ranks (gathers, reduce-scatters and waits between the layers).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from model import GPT, GPTConfig
from models import _gpt_batch
from torch import fx

import zerocc
from zerocc.backends import BACKENDS, eager
from zerocc.backends.inductor.region_keys import canonical, region_key
from zerocc.backends.inductor.regions import find_regions, layer_of
from zerocc.ir.nodes import info, tag

TOL = 1e-5  # against the eager backend, fp32 (as tests/backends/test_inductor.py)


def _gpt(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=layers, n_head=2, n_embd=16))


def _compiled(layers: int, backend: str = "inductor", steps: int = 2):
    """The losses of ``steps`` steps, the executable, and how many graphs went to compile_fx."""
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx
    calls = []

    def counting(gm: fx.GraphModule, *args, **kwargs):
        calls.append(gm)
        return real(gm, *args, **kwargs)

    plan = {
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "backend": {"name": backend, "device": "cpu"},
    }
    with mock.patch.object(compile_fx_module, "compile_fx", counting):
        step = zerocc.compile(_gpt(layers), plan, comm=zerocc.FakeComm(world_size=2))
        losses = [float(step(*_gpt_batch(i, 0))) for i in range(steps)]
    return losses, step._last_program.run, len(calls)


def test_the_graphs_compiled_do_not_grow_with_the_layers():
    """2 and 8 layers: the same number of graphs compiled (before: one per region, 9 and 21),
    each a layer's copies running their first copy's code; trained as eager trains."""
    _, two, compiled_two = _compiled(2)
    losses, eight, compiled_eight = _compiled(8)
    assert compiled_two == two.compilations, (compiled_two, two.notes())
    assert compiled_eight == eight.compilations, (compiled_eight, eight.notes())
    assert compiled_eight == compiled_two, (compiled_two, compiled_eight, eight.notes())
    # Each of the 8 layers has a forward and a backward region; all but the first and last
    # layers' (which the next unit's gather and the head cut otherwise) run another's code.
    assert all(r.fallback is None for r in eight.reports)
    shared = [r for r in eight.reports if r.same_as is not None]
    assert len(shared) == len(eight.reports) - compiled_eight >= 2 * (8 - 2)
    assert f"compiled as {compiled_eight} graphs" in eight.notes()[0], eight.notes()
    torch.manual_seed(0)
    eager = zerocc.compile(
        _gpt(8),
        {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "optimizer": {"lr": 1e-2}},
        comm=zerocc.FakeComm(world_size=2),
    )
    for i, loss in enumerate(losses):
        expected = float(eager(*_gpt_batch(i, 0)))
        assert abs(loss - expected) <= TOL * abs(expected), (i, loss, expected)


def test_inductor_is_the_per_layer_form_and_the_whole_graph_keeps_a_name():
    """``backend.name: inductor`` compiles by region (it was the whole graph, now
    ``inductor-whole``); ``inductor-regions``, its name before, is the same form."""
    from zerocc.backends import get_backend
    from zerocc.backends import inductor as backend

    assert get_backend("inductor") is get_backend("inductor-regions") is backend.compile
    assert get_backend("inductor-whole") is backend.compile_whole


def test_the_whole_program_is_one_graph():
    _, executable, compiled = _compiled(2, backend="inductor-whole", steps=1)
    assert executable.compiled_whole is not None
    assert compiled == executable.compilations == 1


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("transformer.h.3.attn.c_proj", "transformer.h.3"),
        ("transformer.h.12", "transformer.h.12"),
        ("layers.0.experts.1", "layers.0"),
        ("lm_head", ""),
        ("", ""),
        (None, None),
    ],
)
def test_a_nodes_layer_is_the_first_numbered_child_its_module_lies_in(module, layer):
    node = fx.Graph().placeholder("x")
    tag(node, module=module)
    assert layer_of(node) == layer


def test_regions_differing_only_in_names_share_a_key():
    """The key is the canonical module's code and its inputs' layouts: node names do not count,
    targets, literals and layouts do."""

    def gm(literal: float, shape: tuple[int, ...], names: str) -> fx.GraphModule:
        graph = fx.Graph()
        a = graph.placeholder(f"{names}_a")
        b = graph.placeholder(f"{names}_b")
        a.meta["val"] = torch.empty(shape)
        b.meta["val"] = torch.empty(shape)
        added = graph.call_function(torch.ops.aten.add.Tensor, (a, b), name=f"{names}_add")
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (added, literal))
        added.meta["val"] = scaled.meta["val"] = torch.empty(shape)
        graph.output((scaled,))
        return fx.GraphModule(torch.nn.Module(), graph)

    first, _ = region_key(gm(2.0, (4, 4), "layer0"))
    assert region_key(gm(2.0, (4, 4), "layer7"))[0] == first
    assert region_key(gm(3.0, (4, 4), "layer0"))[0] != first  # another literal
    assert region_key(gm(2.0, (4, 2), "layer0"))[0] != first  # another shape
    named = canonical(gm(2.0, (4, 4), "layer7"))
    assert [n.name for n in named.graph.nodes] == ["in_0", "in_1", "v0", "v1", "output"]


def test_inputs_sharing_a_storage_are_in_the_key():
    """Two views of one tensor are not two tensors: Inductor's code may assume either."""

    def gm(a_value: torch.Tensor, b_value: torch.Tensor) -> fx.GraphModule:
        graph = fx.Graph()
        a, b = graph.placeholder("a"), graph.placeholder("b")
        a.meta["val"], b.meta["val"] = a_value, b_value
        out = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
        out.meta["val"] = torch.empty(4)
        graph.output((out,))
        return fx.GraphModule(torch.nn.Module(), graph)

    flat = torch.empty(8)
    shared, _ = region_key(gm(flat[:4], flat[4:]))
    apart, _ = region_key(gm(torch.empty(8)[:4], torch.empty(8)[4:]))
    assert shared != apart


def test_each_layers_compute_is_a_region_of_its_own_at_one_rank():
    """One rank gathers nothing between the layers: without the cut at layers the step's
    forward was one region (488 ops at 3 layers); now each layer's forward is one region."""
    bound = {}

    def keep(program, example, ctx):
        executable = eager.compile(program, example, ctx)
        bound["gm"] = executable.gm
        return executable

    plan = {
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "optimizer": {"lr": 1e-2},
        "backend": {"name": "keep"},
    }
    with mock.patch.dict(BACKENDS, {"keep": keep}):
        step = zerocc.compile(_gpt(3), plan, comm=zerocc.FakeComm(world_size=1))
        step(*_gpt_batch(0, 0))
    regions = find_regions(bound["gm"])
    layers = [{layer_of(n) for n in r.nodes} - {None} for r in regions]
    assert all(len(found) == 1 for found in layers), layers
    forward = [
        layer
        for (layer,), region in zip(layers, regions, strict=True)
        if info(region.nodes[0]).phase == "forward" and layer
    ]
    assert forward == [f"transformer.h.{i}" for i in range(3)]
