"""The plan's optimizers (zerocc/compiler/plan/optimizers.py): each name with its own fields,
torch's defaults, their ranges, a clear error for a field of another optimizer, and the states
each keeps. No ranks: the plan alone."""

from __future__ import annotations

import inspect

import pytest
import torch

from zerocc.compiler.plan import OptimizerConfig, Plan, load_plan, plan_json_schema
from zerocc.compiler.plan.optimizers import COMMON_FIELDS, OPTIMIZERS, flat_hyper, hyper_of
from zerocc.compiler.state import STEP_SPEC, StateLayout, declare_optimizer_state, optimizer_states
from zerocc.errors import PlanError

# The elementwise optimizers (those updated on a flat shard; an optimizer that needs whole
# tensors, Muon, has its own tests).
ELEMENTWISE = [name for name, kind in OPTIMIZERS.items() if not kind.whole_tensors]
TORCH_BACKED = [name for name in ELEMENTWISE if OPTIMIZERS[name].torch_name]
# The plan's defaults that differ from torch's, on purpose: AdamW's weight decay is 0 unless
# the plan sets it (as it was before the registry; torch.optim.AdamW's is 0.01).
PLAN_OWN = {("adamw", "weight_decay")}


def _error(optimizer: dict) -> str:
    with pytest.raises(PlanError) as info:
        load_plan({"optimizer": optimizer})
    return str(info.value)


@pytest.mark.parametrize("name", TORCH_BACKED)
def test_defaults_are_torch_optims(name):
    """Each field left out (and lr) takes the default of torch.optim's class of that name."""
    kind = OPTIMIZERS[name]
    signature = inspect.signature(getattr(torch.optim, kind.torch_name).__init__).parameters
    config = load_plan({"optimizer": {"name": name}}).optimizer
    for field in ("lr", *kind.fields):
        assert field in signature, f"torch.optim.{kind.torch_name} has no {field}"
        if (name, field) in PLAN_OWN:
            continue
        value = getattr(config, field)
        expected = signature[field].default
        assert (tuple(value) if field == "betas" else value) == expected, field


def test_lions_defaults_are_the_papers():
    config = load_plan({"optimizer": {"name": "lion"}}).optimizer
    assert (config.lr, config.betas, config.weight_decay) == (1e-4, (0.9, 0.99), 0.0)


def test_an_unknown_name_lists_every_optimizer():
    message = _error({"name": "lamb"})
    assert "optimizer.name" in message and "'lamb'" in message
    assert all(f"'{name}'" in message for name in OPTIMIZERS)


@pytest.mark.parametrize(
    ("optimizer", "said"),
    [
        ({"name": "lion", "eps": 1e-6}, "eps does not apply to lion; it reads lr, grad_clip, "
         "schedule, betas, weight_decay (eps is read by adamw, adam, adagrad"),
        ({"name": "adagrad", "betas": [0.9, 0.9], "alpha": 0.9},
         "alpha, betas do not apply to adagrad"),
        ({"name": "sgd", "centered": True}, "(centered is read by rmsprop)"),
        ({"name": "adamw", "amsgrad": True}, "amsgrad does not apply to adamw"),
    ],
)  # fmt: skip
def test_a_field_of_another_optimizer_is_an_error(optimizer, said):
    assert said in _error(optimizer)


@pytest.mark.parametrize(
    ("optimizer", "said"),
    [
        ({"name": "rmsprop", "alpha": 1.0}, "optimizer.alpha"),
        ({"name": "sgd", "dampening": -0.1}, "optimizer.dampening"),
        ({"name": "sgd", "momentum": 1.0}, "optimizer.momentum"),
        ({"name": "adagrad", "lr_decay": -1.0}, "optimizer.lr_decay"),
        ({"name": "adagrad", "initial_accumulator_value": -1.0},
         "optimizer.initial_accumulator_value"),
        ({"name": "nadam", "momentum_decay": -1e-3}, "optimizer.momentum_decay"),
        ({"name": "adagrad", "eps": 0.0}, "optimizer.eps"),
        ({"name": "lion", "lr": 2.0}, "a Lion step moves each weight by exactly lr"),
        ({"name": "sgd", "lr": 20.0}, "allowed: a finite number from 1.18e-38 to 10 for sgd"),
        ({"name": "sgd", "nesterov": True}, "nesterov needs momentum > 0 and dampening 0"),
        ({"name": "sgd", "nesterov": True, "momentum": 0.9, "dampening": 0.1},
         "nesterov needs momentum > 0 and dampening 0"),
        ({"name": "radam", "decoupled_weight_decay": "often"}, "optimizer.decoupled_weight_decay"),
    ],
)  # fmt: skip
def test_fields_out_of_range_are_errors(optimizer, said):
    assert said in _error(optimizer)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_a_dumped_plan_loads_again_with_its_own_fields_alone(name):
    plan = load_plan({"optimizer": {"name": name}})
    dumped = plan.model_dump(mode="json")
    assert set(dumped["optimizer"]) == {*COMMON_FIELDS, *OPTIMIZERS[name].fields}
    assert load_plan(dumped).optimizer == plan.optimizer


@pytest.mark.parametrize(
    ("optimizer", "states", "steps"),
    [
        ({"name": "adamw"}, ("exp_avg", "exp_avg_sq"), True),
        ({"name": "sgd"}, (), False),
        ({"name": "sgd", "momentum": 0.9}, ("momentum_buffer",), False),
        ({"name": "sgd", "momentum": 0.9, "dampening": 0.5}, ("momentum_buffer",), True),
        ({"name": "adam", "amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), True),
        ({"name": "adagrad"}, ("sum",), True),
        ({"name": "rmsprop"}, ("square_avg",), True),
        ({"name": "rmsprop", "momentum": 0.5, "centered": True},
         ("square_avg", "momentum_buffer", "grad_avg"), True),
        ({"name": "nadam"}, ("exp_avg", "exp_avg_sq"), True),
        ({"name": "radam"}, ("exp_avg", "exp_avg_sq"), True),
        ({"name": "adamax"}, ("exp_avg", "exp_inf"), True),
        ({"name": "lion"}, ("exp_avg",), False),
    ],
)  # fmt: skip
def test_the_states_each_keeps(optimizer, states, steps):
    """The states checkpoints save and the step counter, as torch.optim names and keeps them
    (NAdam's mu_product, a function of the step, is not kept: see torch_optim.py)."""
    plan = Plan.model_validate({"optimizer": optimizer})
    assert optimizer_states(plan.optimizer) == states
    layout = StateLayout()
    declare_optimizer_state(layout, [], plan)
    assert (STEP_SPEC.key in layout) == steps


def test_the_hyperparameters_travel_as_floats_and_back():
    config = OptimizerConfig(name="rmsprop", alpha=0.9, centered=True, momentum=0.5)
    flat = flat_hyper(config.kind, config.hyper())
    assert all(isinstance(v, float) for v in flat)
    assert hyper_of(config.kind, flat) == {**config.hyper(), "centered": 1.0}
    nadam = OptimizerConfig(name="nadam", betas=(0.8, 0.9))
    assert hyper_of(nadam.kind, flat_hyper(nadam.kind, nadam.hyper()))["betas"] == (0.8, 0.9)


def test_the_schema_lists_every_optimizer_and_its_fields():
    schema = plan_json_schema()["$defs"]["OptimizerConfig"]["properties"]
    assert schema["name"]["enum"] == list(OPTIMIZERS)
    for kind in map(OPTIMIZERS.get, ELEMENTWISE):
        for field in kind.fields:
            readers = schema[field]["description"].split(":")[0]
            assert kind.name in readers or readers == "every optimizer", (kind.name, field)


def test_a_default_filled_in_is_not_a_field_the_plan_set():
    """torch's defaults fill the fields left out, unset: the Trainer's and Lightning's
    arguments fill what the plan did not set, and check what it did."""
    config = load_plan({"optimizer": {"name": "adagrad"}}).optimizer
    assert (config.lr, config.eps) == (1e-2, 1e-10)
    assert config.model_fields_set == {"name"}
    given = load_plan({"optimizer": {"name": "adagrad", "lr": 1e-2}}).optimizer
    assert given.model_fields_set == {"name", "lr"}
