"""TrainStep: program cache, full state dict, meta-device state, explain."""

from __future__ import annotations

import pytest
import torch
from models import build
from parity import batch_of

import zerocc

PLAN = {"zero": {"stage": 3}, "units": {"classes": ["Block"]}, "optimizer": {"eps": 1e-3}}


def _batch(i: int, size: int = 2):
    return (
        batch_of({"model": "gpt"}, i, 0)
        if size == 2
        else tuple(t[:size] for t in batch_of({"model": "gpt"}, i, 0))
    )


def test_programs_are_cached_by_batch_signature():
    step = zerocc.compile(build("gpt"), PLAN)
    step(*_batch(0))
    step(*_batch(1))
    assert len(step.programs) == 1
    step(*_batch(2, size=1))  # the short last batch of an epoch
    assert len(step.programs) == 2
    step(*_batch(3))
    assert len(step.programs) == 2


def test_the_time_before_training_is_told_by_phase():
    """explain() and summary() say where setup went: the states at compile, then each
    program's capture, passes, lowering and first run, once (later runs add nothing)."""
    step = zerocc.compile(build("gpt"), PLAN)
    assert list(step.summary()["setup_seconds"]) == ["model states"]
    step(*_batch(0))
    once = step.summary()["setup_seconds"]
    assert list(once) == ["model states", "capture and passes", "lowering", "first run"]
    assert all(s > 0 for s in once.values())
    step(*_batch(1))  # the same program
    assert step.summary()["setup_seconds"] == once
    step(*_batch(2, size=1))  # a second program: its phases added
    twice = step.record().setup_seconds
    assert twice["model states"] == once["model states"]
    assert all(twice[p] > once[p] for p in ("capture and passes", "lowering", "first run"))
    line = next(line for line in step.explain().splitlines() if line.startswith("setup: "))
    assert line.startswith(f"setup: model states {once['model states']:.1f} s, capture and ")


def test_full_state_dict_loads_strictly_into_a_fresh_model():
    step = zerocc.compile(build("gpt"), PLAN)
    step(*_batch(0))
    fresh = build("gpt")
    fresh.load_state_dict(step.full_state_dict(), strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    loss = fresh(*_batch(1))
    assert torch.allclose(loss, step(*_batch(1)), rtol=1e-6)


def test_explain_shows_units_comm_and_formula():
    step = zerocc.compile(
        build("odd"), {"zero": {"stage": 2}, "units": {"modules": ["a"]}}, comm=zerocc.FakeComm(4)
    )
    step(*batch_of({"model": "odd"}, 0, 0))
    text = step.explain()
    assert "ZeRO stage 2, world size 4, 2 units" in text
    assert "reduce_scatter" in text and "all_gather" in text
    assert "ZeRO formula" in text and "optimizer" in text


def test_meta_model_materializes_one_unit_at_a_time(monkeypatch):
    import zerocc.compiler.state as state_module

    sizes = []
    real = state_module.initial_values

    def counting(model, fqns, seed, device):
        values = real(model, fqns, seed, device)
        sizes.append(sum(v.numel() for v in values.values()))
        return values

    monkeypatch.setattr(state_module, "initial_values", counting)
    with torch.device("meta"):
        model = build("gpt")
    step = zerocc.compile(model, PLAN, comm=zerocc.FakeComm(2))
    step(*_batch(0))
    assert all(p.is_meta for p in model.parameters())
    assert max(sizes) == max(u.numel for u in step.units)
    assert sum(v.numel() for k, v in step.state.items() if k.endswith(".param")) == sum(
        u.shard_numel for u in step.units
    )


def test_predicted_comm_counts_every_micro_batch_of_a_step():
    plan = {**PLAN, "zero": {"stage": 2}, "grad_accumulation": 3}
    step = zerocc.compile(build("gpt"), plan, comm=zerocc.FakeComm(2))
    for i in range(3):
        step(*_batch(i))
    psi_bytes = 4 * sum(u.padded_numel for u in step.units)
    predicted = zerocc.inspect.explain.comm_bytes_per_step(step.record())
    # Once per step, the all-reduce of one non-finite flag (fp32) per unit.
    flags_bytes = 2 * 4 * len(step.units)
    assert predicted == {
        "reduce_scatter": 3 * psi_bytes,
        "all_gather": psi_bytes,
        "all_reduce": flags_bytes,
    }


def test_explain_before_the_first_step_shows_units_and_model_states():
    step = zerocc.compile(build("gpt"), PLAN, comm=zerocc.FakeComm(2))
    text = step.explain()
    assert "transformer.h.1" in text and "ZeRO formula" in text
    assert "known once the step is compiled" in text


def test_a_stage_3_plan_that_names_no_units_gets_the_repeated_block():
    """Stage 3 naming no units takes the model's repeated block (`units: auto`), said in
    explain(); a model without one keeps one unit, gathered whole, and a PlanWarning says so;
    with units, or at stage 2, nothing is said."""
    import warnings

    from zerocc.errors import PlanWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)
        step = zerocc.compile(build("gpt"), {"zero": {"stage": 3}}, comm=zerocc.FakeComm(2))
        zerocc.compile(build("gpt"), PLAN, comm=zerocc.FakeComm(2))
        zerocc.compile(build("gpt"), {"zero": {"stage": 2}}, comm=zerocc.FakeComm(2))
    assert [u.name for u in step.units] == ["root", "transformer.h.0", "transformer.h.1"]
    assert "units: auto: one per Block, the model's repeated block" in step.explain()
    flat = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    with pytest.warns(PlanWarning, match=r"gathered at once.*units: auto found no repeated block"):
        zerocc.compile(flat, {"zero": {"stage": 3}}, loss_fn=lambda m, x: m(x).sum(),
                       comm=zerocc.FakeComm(2))  # fmt: skip


def test_the_repeated_block_of_a_hugging_face_model_is_its_decoder_layer():
    pytest.importorskip("transformers")
    from zerocc.compiler.capture import describe_model
    from zerocc.compiler.passes.partition import repeated_block

    assert repeated_block(describe_model(build("llama"))) == "LlamaDecoderLayer"
    assert repeated_block(describe_model(build("gpt"))) == "Block"
