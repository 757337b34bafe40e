"""DeepSpeed configs as plans: `zerocc plan import` and `zerocc.compile(model, "ds.json")`.

The fixtures (tests/fixtures/deepspeed/) are DeepSpeed's own examples, written out:
zero2_offload.json the ZeRO-Offload tutorial's (deepspeed.ai/tutorials/zero-offload) with a
batch, Adam and fp16 block; zero3_offload.json and zero3_nvme.json the ZeRO-3 Offload and
ZeRO-Infinity NVMe examples of deepspeed.ai/docs/config-json; getting_started.json the
getting-started config with the docs' fp16 and WarmupLR blocks; bf16_cosine.json bf16 with
WarmupCosineLR; hf_zero3_auto.json Hugging Face's ds_config_zero3.json ("auto" values);
unsupported.json options zerocc does not have.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from models import build, entry

import zerocc
from zerocc.compiler.plan.deepspeed import convert

FIXTURES = Path(__file__).parents[2] / "fixtures" / "deepspeed"
CONVERTIBLE = sorted(p.name for p in FIXTURES.glob("*.json") if p.name != "unsupported.json")


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _leaves(config: dict, prefix: str = "") -> list[str]:
    """Every key path of a config, nested objects opened (an optimizer's params too)."""
    out = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) and value else [path]
    return out


@pytest.mark.parametrize("name", [*CONVERTIBLE, "unsupported.json"])
def test_every_key_is_accounted_for(name):
    config = _config(name)
    _, outcomes = convert(config)
    keys = [o.key for o in outcomes]
    for leaf in _leaves(config):
        assert any(leaf == k or leaf.startswith(k + ".") for k in keys), leaf


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_deepspeeds_examples_load_as_plans(name):
    plan = zerocc.load_plan(FIXTURES / name)
    zero = _config(name)["zero_optimization"]
    assert plan.zero.stage == (1 if zero is True else zero["stage"])


def test_zero3_offload_example():
    plan = zerocc.load_plan(FIXTURES / "zero3_offload.json")
    assert (plan.offload.optimizer, plan.offload.params) == ("cpu", "cpu")
    assert plan.precision.param == "bf16" and plan.precision.reduce == "bf16"  # DeepSpeed's
    assert plan.optimizer.lr == 3e-5 and plan.optimizer.betas == (0.8, 0.999)
    assert plan.overlap.max_inflight_mb == pytest.approx(1e7 * 2 / 2**20, abs=1e-3)  # bf16
    assert plan.units.keep_gathered_below_mb == pytest.approx(1e5 * 2 / 2**20, abs=1e-3)


def test_zero2_offload_example_keeps_deepspeeds_loss_scaler():
    plan = zerocc.load_plan(FIXTURES / "zero2_offload.json")
    assert plan.zero.stage == 2 and plan.offload.optimizer == "cpu"
    assert plan.grad_accumulation == 2 and plan.optimizer.grad_clip == 1.0
    dynamic = plan.precision.dynamic
    assert plan.precision.param == "fp16" and plan.precision.scaling == "dynamic"
    assert (dynamic.initial, dynamic.growth_interval, dynamic.hysteresis) == (2.0**16, 1000, 2)


def test_deepspeeds_defaults_are_written_where_they_differ():
    """An fp16 block without its scaler's knobs gets DeepSpeed's (a window of 1000 steps, not
    torch's 2000); WarmupDecayLR without warmup_max_lr peaks at DeepSpeed's 0.001."""
    config = {
        "fp16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 5e-4}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
    }
    plan = zerocc.load_plan(config)
    assert plan.precision.dynamic.growth_interval == 1000 and plan.precision.reduce == "fp16"
    assert plan.optimizer.schedule.name == "warmup_decay_lr"
    assert plan.optimizer.schedule.warmup_max_lr == 0.001


def test_hugging_face_auto_values_take_zeroccs_defaults():
    plan = zerocc.load_plan(FIXTURES / "hf_zero3_auto.json")
    assert plan.precision.param == "fp32"  # fp16/bf16 "auto": the Trainer decides, not zerocc
    assert plan.optimizer.lr == 1e-3 and plan.grad_accumulation == 1
    assert plan.optimizer.schedule.name == "warmup_lr"
    _, outcomes = convert(_config("hf_zero3_auto.json"))
    assert any(o.key == "optimizer.params.lr" and "'auto'" in o.note for o in outcomes)


def test_unsupported_options_are_errors_naming_each():
    with pytest.raises(zerocc.PlanError) as error:
        zerocc.load_plan(FIXTURES / "unsupported.json")
    for key in (
        "OneBitAdam",
        "amp",
        "zero_quantized_nontrainable_weights",
        "partition_activations",
        "cpu_checkpointing",
        "some_new_option",
    ):
        assert key in str(error.value), key


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
        ({"optimizer": {"type": "OneBitAdam", "params": {}}}, "DeepSpeed's 1-bit Adam"),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "LAMB .* zerocc's are Adam, AdamW, SGD"),
        ({"optimizer": {"type": "MuAdamW", "params": {}}}, "MuP's AdamW"),
        ({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.9]}}},
         "not a parameter of zerocc's adagrad"),
        ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "amsgrad"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "WarmupLR"),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}}, "auto"),
        ({"zero_optimization": {"stage": 5}}, "allowed: 0, 1, 2, 3"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "hysteresis"),
    ],
)
def test_what_zerocc_cannot_do_is_an_error(config, message):
    with pytest.raises(zerocc.PlanError, match=message):
        zerocc.load_plan(config)


def test_compile_takes_a_deepspeed_config_and_trains():
    """A step of the bf16 WarmupCosineLR example, for two simulated ranks."""
    model, batch = build("buffers"), entry("buffers")[1](0, 0)
    step = zerocc.compile(model, str(FIXTURES / "bf16_cosine.json"), comm=zerocc.FakeComm(2))
    loss = step(*batch)
    assert torch.isfinite(loss) and step.plan.optimizer.schedule.name == "warmup_cosine_lr"
    assert step.plan.precision.param == "bf16" and step.lr == 0.0  # DeepSpeed's 2nd step too


def test_plan_import_prints_every_key_and_writes_a_plan(tmp_path):
    out = tmp_path / "plan.yaml"
    command = [
        sys.executable,
        "-m",
        "zerocc",
        "plan",
        "import",
        str(FIXTURES / "zero2_offload.json"),
    ]
    # (the example's workload by its file: `plan check` imports it)
    workload = f"{Path(__file__).parents[3] / 'examples' / 'gpt' / 'workload.py'}:workload"
    run = subprocess.run([*command, "-o", str(out), "--workload", workload],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "mapped      zero_optimization.stage = 2: zero.stage: 2" in run.stdout
    assert "ignored     zero_optimization.reduce_bucket_size" in run.stdout
    assert "27 option(s): 17 mapped" in run.stdout
    plan = zerocc.load_plan(out)
    assert plan.workload == workload and plan.zero.stage == 2
    check = subprocess.run([sys.executable, "-m", "zerocc", "plan", "check", str(out)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_plan_import_of_unsupported_options_fails_and_writes_nothing(tmp_path):
    out = tmp_path / "plan.yaml"
    config = str(FIXTURES / "unsupported.json")
    command = [sys.executable, "-m", "zerocc", "plan", "import", config]
    run = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and not out.exists()
    assert "6 option(s) zerocc does not support" in run.stderr
    assert "unsupported some_new_option = 1" in run.stdout


def test_plan_import_of_zero3_gives_the_plan_auto_units(capsys, tmp_path):
    """DeepSpeed gathers parameter by parameter: the imported stage-3 plan takes the model's
    repeated block as its units (`units: auto`) and says so, not one whole-model unit."""
    from zerocc.cli.main import main

    out = tmp_path / "plan.yaml"
    assert main(["plan", "import", str(FIXTURES / "hf_zero3_auto.json"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "note: units: auto: each of the model's repeated blocks (its layers) is a unit" in printed
    )
    assert "units: auto (the repeated block)" in printed
    assert "zerocc's default applies (optimizer.lr: 0.001)" in printed
    assert yaml.safe_load(out.read_text())["units"] == "auto"


def test_zero_plus_int8_weights_and_gradients_map_to_quantized_collectives():
    """ZeRO++'s qwZ (``zero_quantized_weights``) is zerocc's int8 weight gather at stage 3, its
    qgZ (``zero_quantized_gradients``) the int8 gradient exchange at stages 1-3, its hpZ
    (``zero_hpz_partition_size``) the secondary partition at stage 3; at another stage there is
    nothing to quantize or copy, and the conversion says so."""
    config = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                    "zero_quantized_gradients": True,
                                    "zero_hpz_partition_size": 8}}  # fmt: skip
    plan, outcomes = convert(config)
    assert plan["zero"]["quantized_weights"] == "int8"
    assert plan["zero"]["quantized_grads"] == "int8"
    assert plan["zero"]["secondary_group"] == 8
    assert any("zero.quantized_weights" in o.note for o in outcomes)
    assert zerocc.load_plan(plan).zero.quantized_weights == "int8"
    plan, outcomes = convert({"zero_optimization": {"stage": 2, "zero_quantized_weights": True,
                                                    "zero_hpz_partition_size": 8}})  # fmt: skip
    assert "quantized_weights" not in plan["zero"] and "secondary_group" not in plan["zero"]
    assert sum("applies at stage 3" in o.note for o in outcomes) == 2


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"type": "Adam", "params": {"adam_w_mode": False, "lr": 1e-3, "amsgrad": True}},
         {"name": "adam", "amsgrad": True}),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
         {"name": "sgd", "nesterov": True, "momentum": 0.9}),
        ({"type": "Adagrad", "params": {"lr": 0.01, "lr_decay": 0.1, "eps": 1e-10}},
         {"name": "adagrad", "lr_decay": 0.1, "eps": 1e-10}),
        ({"type": "RMSprop", "params": {"lr": 1e-3, "alpha": 0.9, "centered": True}},
         {"name": "rmsprop", "alpha": 0.9, "centered": True}),
        ({"type": "NAdam", "params": {"lr": 1e-3, "momentum_decay": 1e-3}},
         {"name": "nadam", "momentum_decay": 1e-3}),
        ({"type": "RAdam", "params": {"decoupled_weight_decay": True, "weight_decay": 0.1}},
         {"name": "radam", "decoupled_weight_decay": True}),
        ({"type": "Adamax", "params": {"betas": [0.8, 0.9]}},
         {"name": "adamax", "betas": (0.8, 0.9)}),
        ({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}},
         {"name": "lion", "betas": (0.95, 0.98), "weight_decay": 0.1}),
    ],
)  # fmt: skip
def test_deepspeeds_optimizers_map_to_the_plans(block, expected):
    """DeepSpeed's own types and the torch.optim classes it builds by name, with their
    parameters, as the plan's optimizers (Adam with adam_w_mode false is Adam, not AdamW)."""
    optimizer = zerocc.load_plan({"optimizer": block}).optimizer
    for field, value in expected.items():
        assert getattr(optimizer, field) == value, field


def test_the_parameters_deepspeed_maps_are_the_registrys_fields():
    from zerocc.compiler.plan.deepspeed.optimizer import _OPTIMIZERS, _PARAMS
    from zerocc.compiler.plan.optimizers import OPTIMIZERS

    elementwise = {n for n, k in OPTIMIZERS.items() if not k.whole_tensors}
    assert set(_OPTIMIZERS.values()) | {"adam"} == elementwise
    for name in elementwise:
        assert set(_PARAMS[name]) == {"lr", *OPTIMIZERS[name].fields}, name
