"""`zerocc plan auto` on a deep model (issue 52): candidates drawn from shallow copies of the
model (the line through compiles at 4 and 6 blocks), the pick compiled whole. The lines are
checked against whole compiles of every candidate; the figures are the cost model's
(deterministic)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from zerocc.cli.main import main
from zerocc.compiler.plan import load_plan
from zerocc.compiler.workload import Workload, load_workload
from zerocc.cost.rates import rates_for
from zerocc.inspect.plan_depth import DEPTHS, BlockStack, confirmed
from zerocc.inspect.plan_search import search_plans

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"
DEEP = {  # the example GPT, 16 blocks deep and narrow: stage and recompute searched
    "workload": f"{EXAMPLES / 'workload.py'}:workload",
    "workload_args": {"n_layer": 16, "n_embd": 32, "n_head": 2, "block_size": 16,
                      "batch_size": 2},
    "units": {"classes": ["Block"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def both():
    plan = load_plan(DEEP)
    rates = rates_for(plan, "cpu")
    whole = search_plans(plan, 2, 2**40, rates, exhaustive=True, whole=True)
    lines = search_plans(plan, 2, 2**40, rates, exhaustive=True)
    return plan, rates, whole, lines


def test_the_stack_is_found_and_cut_without_copying_the_model():
    model = load_workload(load_plan(DEEP)).model
    stack = BlockStack.of(model)
    assert stack == BlockStack("transformer.h", "Block", 16)
    cut = stack.cut(model, 4)
    assert len(cut.transformer.h) == 4 and len(model.transformer.h) == 16  # (the model intact)
    assert cut.transformer.h[3] is model.transformer.h[3]
    assert cut.transformer.wte is model.transformer.wte and cut.lm_head is model.lm_head
    held = {id(p) for p in model.parameters()}
    assert all(id(p) in held for p in cut.parameters())
    # too shallow to be worth it, or no stack of one class
    shallow = load_plan({**DEEP, "workload_args": {"n_layer": 4}})
    assert BlockStack.of(load_workload(shallow).model) is None
    mixed = nn.ModuleList([nn.Linear(2, 2) if i % 2 else nn.ReLU() for i in range(20)])
    assert BlockStack.of(nn.Sequential(mixed)) is None


def test_each_line_is_the_whole_compile_and_the_pick_is_compiled_whole(both):
    """Every candidate's line (peak, step, bytes per mesh group) equals its whole compile:
    peaks to the byte, steps to rounding; the pick is the whole search's, compiled whole; few
    candidates are compiled whole."""
    _, _, whole, lines = both
    by_fields = {str(c.fields): c for c in whole.candidates}
    assert len(lines.grid) == len(whole.grid) == 12
    drawn = [c for c in lines.candidates if c.extrapolated]
    assert len(drawn) >= len(lines.candidates) - 2  # (at most 2 compiled whole)
    for c in drawn:
        twin = by_fields[str(c.fields)]
        assert c.peak == twin.peak, c.describe()
        assert c.step_s == pytest.approx(twin.step_s, rel=1e-9), c.describe()
        assert c.moved == twin.moved and c.work == twin.work, c.describe()
    assert lines.best is not None and not lines.best.extrapolated
    assert lines.best == by_fields[str(lines.best.fields)] == whole.best
    table = lines.format()
    assert "≈" in table and f"cut to {DEPTHS[0]} and {DEPTHS[1]} of its 16 Blocks" in table
    assert "≈" not in whole.format()


def test_a_pick_that_does_not_fit_whole_gives_way_to_the_next(both):
    """The line of the fastest is over the memory when compiled whole: the next fastest is
    compiled whole and chosen."""
    _, _, whole, _ = both
    fast, slow = sorted(whole.candidates, key=lambda c: c.step_s)[:2]
    line = [dataclasses.replace(c, extrapolated=True) for c in (fast, slow)]
    memory = max(fast.peak, slow.peak)
    bigger = {str(fast.fields): dataclasses.replace(fast, peak=memory + 1)}
    compiled = []

    def compile_whole(fields):
        compiled.append(fields)
        return bigger.get(str(fields), slow if fields == slow.fields else fast)

    out = confirmed(line, compile_whole, memory)
    assert compiled == [fast.fields, slow.fields]
    assert [c.extrapolated for c in out] == [False, False] and not out[0].fits(memory)
    assert min((c for c in out if c.fits(memory)), key=lambda c: c.step_s) == slow


def test_a_plan_naming_a_block_beyond_the_cut_is_compiled_whole(both):
    plan, rates, _, _ = both
    fixed = load_plan({**DEEP, "recompute": {"units": ["transformer.h.15"]}})
    searched = search_plans(fixed, 2, 2**40, rates, exhaustive=True)
    assert all(c.error is None and not c.extrapolated for c in searched.candidates)


def test_plan_auto_whole_compiles_every_candidate_at_depth(tmp_path, capsys):
    plan = tmp_path / "deep.yaml"
    plan.write_text(
        f"workload: {DEEP['workload']}\nworkload_args: {DEEP['workload_args']}\n"
        "units: {classes: [Block]}\nzero: {stage: 3}\n"
    )
    assert main(["plan", "auto", str(plan), "--world-size", "2", "--whole"]) == 0
    assert "≈" not in capsys.readouterr().out
    assert main(["plan", "auto", str(plan), "--world-size", "2", "--overwrite"]) == 0
    assert "≈" in capsys.readouterr().out


class _Llama(nn.Module):
    """A Hugging Face Llama 16 layers deep (4 heads of 8, 2 key/value heads), its own labels."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=16, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        self.lm = LlamaForCausalLM(config)

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def _tokens(rank: int, world: int):
    generator = torch.Generator().manual_seed(rank)
    while True:
        yield (torch.randint(0, 64, (2, 16), generator=generator),)


def test_a_hugging_face_llama_is_cut_and_drawn_alike():
    """transformers' Llama (its layers under ``lm.model.layers``, each with its own
    ``layer_idx``, the mask and rotary embeddings built from its config): every stage's line
    equals its whole compile, peaks to the byte."""
    pytest.importorskip("transformers")
    workload = Workload(_Llama(), batches=_tokens)
    assert BlockStack.of(workload.model) == BlockStack("lm.model.layers", "LlamaDecoderLayer", 16)
    plan = load_plan({"units": {"classes": ["LlamaDecoderLayer"]}, "recompute": {"units": "all"}})
    rates = rates_for(plan, "cpu")
    whole = search_plans(plan, 2, 2**40, rates, workload, exhaustive=True, whole=True)
    lines = search_plans(plan, 2, 2**40, rates, workload, exhaustive=True)
    by_fields = {str(c.fields): c for c in whole.grid}
    drawn = [c for c in lines.grid if c.extrapolated]
    assert len(drawn) >= 3
    for c in drawn:
        twin = by_fields[str(c.fields)]
        assert c.peak == twin.peak and c.step_s == pytest.approx(twin.step_s, rel=1e-9)
