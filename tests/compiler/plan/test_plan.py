"""Tests of the plan (zerocc/compiler/plan/): its sections and the checks across them, loading,
the messages of invalid plans, the YAML a plan may hold, renamed fields and the schema."""

import math
import typing
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from zerocc.compiler.driver.pass_manager import check_passes, pass_names
from zerocc.compiler.plan import Plan, load_plan, plan_json_schema
from zerocc.errors import PlanError, PlanWarning, RenamedFieldWarning, ZeroccError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "gpt"


def write(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def plan_error(src) -> str:
    with pytest.raises(PlanError) as info:
        load_plan(src)
    message = str(info.value)
    assert "pydantic" not in message and "errors.pydantic.dev" not in message
    return message


def pipeline_error(src) -> str:
    """The PlanError of a plan whose sections load but whose `passes` the contracts refuse
    (`zerocc plan check` and `zerocc.compile` check them)."""
    plan = load_plan(src)
    with pytest.raises(PlanError) as info:
        check_passes(plan)
    return str(info.value)


# --- loading ---------------------------------------------------------------------------------


def test_load_from_path_dict_and_plan(tmp_path):
    path = write(tmp_path, "zero:\n  stage: 2\nunits:\n  classes: [Block]\n")
    from_path = load_plan(path)
    from_str = load_plan(str(path))
    from_dict = load_plan({"zero": {"stage": 2}, "units": {"classes": ["Block"]}})
    assert from_path.zero.stage == from_str.zero.stage == from_dict.zero.stage == 2
    assert from_path.units.classes == from_dict.units.classes == ["Block"]
    assert from_path.source == str(path) and from_dict.source is None
    assert load_plan(from_dict) is from_dict


def test_defaults():
    plan = load_plan({})
    assert plan.zero.stage == 3 and plan.zero.world_size is None
    # stage 3 naming no units: the model's repeated block (`units: auto`)
    assert plan.units.classes == ["auto"] and plan.units.modules == [] and plan.units.min_mb is None
    opt = plan.optimizer
    assert (opt.name, opt.lr, opt.betas, opt.eps) == ("adamw", 1e-3, (0.9, 0.999), 1e-8)
    assert (opt.weight_decay, opt.momentum, opt.grad_clip) == (0.0, 0.0, None)
    assert plan.grad_accumulation == 1 and plan.precision.param == "fp32"
    assert (plan.backend.name, plan.backend.device) == ("eager", "auto")
    assert plan.passes is None and plan.workload is None and plan.workload_args == {}
    assert plan.seed == 0 and plan.source is None


def test_empty_file_is_all_defaults(tmp_path):
    assert load_plan(write(tmp_path, "")).model_dump() == Plan().model_dump()


@pytest.mark.parametrize("name", ["zero0.yaml", "zero1.yaml", "zero2.yaml", "zero3.yaml"])
def test_example_plans_load(name):
    plan = load_plan(EXAMPLES / name)
    assert plan.zero.stage == int(name[4]) and plan.workload == "workload:workload"


def test_source_is_not_a_plan_field():
    assert "unknown field 'source'" in plan_error({"source": "elsewhere.yaml"})
    assert "source" not in Plan().model_dump() and "source" not in plan_json_schema()["properties"]


# --- error messages --------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [5, -1, "3", True, 3.0])
def test_bad_stage_names_path_value_and_allowed_values(tmp_path, stage):
    message = plan_error({"zero": {"stage": stage}})
    assert "zero.stage" in message and repr(stage) in message
    assert "allowed values: 0, 1, 2, 3" in message


def test_error_names_the_file(tmp_path):
    path = write(tmp_path, "zero:\n  stage: 7\n")
    message = plan_error(path)
    assert str(path) in message and "zero.stage" in message and "7" in message


def test_unknown_field_suggests_the_closest_and_lists_allowed():
    message = plan_error({"zero": {"stgae": 3}})
    assert "zero.stgae" in message
    assert "unknown field 'stgae'" in message and "did you mean 'stage'?" in message
    assert "allowed fields here: stage, world_size" in message
    top = plan_error({"optimiser": {}})
    assert "did you mean 'optimizer'?" in top and "grad_accumulation" in top


def test_unknown_field_without_a_close_name_has_no_suggestion():
    message = plan_error({"units": {"xyz": 1}})
    assert "did you mean" not in message
    assert "allowed fields here: classes, modules, min_mb" in message


def test_bad_literal_lists_allowed_values():
    message = plan_error({"optimizer": {"name": "lamb"}})
    assert "optimizer.name" in message and "'lamb'" in message
    assert "'adamw', 'adam', 'sgd'" in message


def test_every_bad_field_is_reported():
    message = plan_error({"zero": {"stage": 9}, "optimizer": {"lr": -1.0}, "seeds": 1})
    assert "zero.stage" in message and "optimizer.lr" in message and "seeds" in message


def test_bad_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "zero:\n  stage: [3\n")
    message = plan_error(path)
    assert "invalid YAML" in message and str(path) in message and "line" in message


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = plan_error(missing)
    assert str(missing) in message and "not found" in message


def test_non_mapping_yaml(tmp_path):
    message = plan_error(write(tmp_path, "- zero\n- stage\n"))
    assert "expected a mapping" in message


def test_section_that_is_not_a_mapping():
    message = plan_error({"zero": 3})
    assert "zero: expected a mapping of fields: stage, world_size" in message


# --- precision -------------------------------------------------------------------------------


def test_a_renamed_section_is_read_under_its_new_name_with_a_warning(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("checkpointing:\n  units: all\n")
    with pytest.warns(RenamedFieldWarning, match=r"`checkpointing:` is now `recompute:`"):
        plan = load_plan(path)
    assert plan.recompute.units == "all"
    assert "checkpointing" not in plan.model_dump()


def test_a_renamed_section_given_under_both_names_is_an_error():
    with pytest.raises(PlanError, match="old name of recompute:, and the plan gives both"):
        load_plan({"checkpointing": {"units": "all"}, "recompute": {"units": "none"}})


def test_a_renamed_field_inside_a_section_is_read_under_its_new_name():
    given = {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "pipeline": "next_forward"}}
    with pytest.warns(RenamedFieldWarning, match=r"`offload.pipeline:` is now `offload.defer_"):
        plan = load_plan(given)
    assert plan.offload.defer_updates == "next_forward"
    assert given["offload"] == {"optimizer": "cpu", "pipeline": "next_forward"}  # (untouched)
    with pytest.raises(PlanError, match="old name of offload.defer_updates:, and the plan gives"):
        load_plan({"offload": {"pipeline": "none", "defer_updates": "none"}})


def test_precision_defaults_and_pipeline():
    plan = load_plan({"precision": {"param": "bf16"}})
    assert plan.precision.scaling == "none" and plan.precision.dtype("buffers") == torch.bfloat16
    assert pass_names(plan) == ["partition", "shard", "precision", "optimizer", "overlap"]
    assert pass_names(load_plan({})) == ["partition", "shard", "optimizer", "overlap"]
    assert pass_names(load_plan({"overlap": {"enabled": False}}))[-1] == "optimizer"
    assert load_plan({"precision": {"param": "fp16"}}).precision.scaling == "dynamic"
    fixed = load_plan({"precision": {"param": "fp16", "loss_scale": 1024}}).precision
    assert fixed.scaling == "static" and fixed.loss_scale == 1024


def test_fp16_without_loss_scaling_warns_about_underflow():
    with pytest.warns(PlanWarning, match="underflow"):
        load_plan({"precision": {"param": "fp16", "loss_scale": "none"}})


@pytest.mark.parametrize(
    ("param", "master", "hint"),
    [("fp32", "bf16", "use master: fp32"), ("bf16", "fp16", "(or bf16 for pure bf16)")],
)
def test_master_lower_than_param_is_rejected(param, master, hint):
    message = plan_error({"precision": {"param": param, "master": master}})
    assert f"precision: master '{master}' is lower than param '{param}'" in message
    assert hint in message


def test_pure_bf16_is_allowed_with_torch_kernels_only():
    assert load_plan({"precision": {"param": "bf16", "master": "bf16"}}).precision.mixed
    message = plan_error(
        {"precision": {"param": "bf16", "master": "bf16"}, "backend": {"kernels": "triton"}}
    )
    assert "backend.kernels: triton updates fp32 master weights" in message


@pytest.mark.parametrize("scale", [-1, 0, "dyn", True])
def test_bad_loss_scale(scale):
    message = plan_error({"precision": {"loss_scale": scale}})
    assert "precision.loss_scale:" in message and "'dynamic', 'none', or a positive" in message


def test_precision_pass_must_be_listed_when_precision_leaves_fp32():
    message = pipeline_error(
        {"precision": {"param": "bf16"}, "passes": ["partition", "shard", "optimizer"]}
    )
    assert "does not list 'precision'" in message


def test_momentum_is_sgd_only():
    message = plan_error({"optimizer": {"momentum": 0.9}})
    assert "momentum does not apply to adamw" in message and "read by sgd, rmsprop" in message
    assert load_plan({"optimizer": {"name": "sgd", "momentum": 0.9}}).optimizer.momentum == 0.9


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("optimizer.lr", 0),
        ("optimizer.eps", -1e-8),
        ("optimizer.weight_decay", -0.1),
        ("optimizer.grad_clip", 0),
        ("grad_accumulation", 0),
        ("zero.world_size", 0),
        ("units.min_mb", 0),
    ],
)
def test_numeric_bounds(field, value):
    section, _, name = field.rpartition(".")
    data = {section: {name: value}} if section else {name: value}
    message = plan_error(data)
    assert field in message and repr(value) in message


def test_betas_each_in_unit_interval():
    assert "optimizer.betas[1]" in plan_error({"optimizer": {"betas": [0.9, 1.0]}})
    assert "optimizer.betas[0]" in plan_error({"optimizer": {"betas": [-0.1, 0.9]}})


# --- numbers a plan cannot train with --------------------------------------------------------


def _float_fields(model: type[BaseModel] = Plan, prefix: tuple[str, ...] = ()):
    """The YAML path of every float field of the plan (tuples of floats and unions included),
    sections nested in sections included: a field added later is covered too."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _float_fields(field.annotation, (*prefix, name))
        elif typing.get_origin(field.annotation) is dict and "float" in str(field.annotation):
            key = typing.get_args(typing.get_args(field.annotation)[0])[0]  # an allowed key
            yield (*prefix, name, key)  # a mapping of floats: one of its values
        elif "float" in str(field.annotation):
            yield (*prefix, name)


def _nested(path: tuple[str, ...], value) -> dict:
    for part in reversed(path):
        value = {part: value}
    return value


FLOAT_FIELDS = list(_float_fields())


def test_float_fields_are_found_in_every_section():
    found = {".".join(path) for path in FLOAT_FIELDS}
    assert {
        "units.min_mb", "optimizer.lr", "optimizer.betas", "precision.loss_scale",
        "precision.dynamic.initial", "backend.timeout_s", "overlap.bucket_mb",
        "cost.latency_us", "offload.ratio",
    } <= found  # fmt: skip


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("path", FLOAT_FIELDS, ids=".".join)
def test_every_float_field_must_be_finite(path, value):
    tuples = {"betas": [0.5, value], "ns_coefficients": [0.5, 0.5, value]}
    message = plan_error(_nested(path, tuples.get(path[-1], value)))
    assert ".".join(path) in message and repr(value) in message and "allowed" in message
    assert "\n" not in message  # one bad field: one line


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("optimizer: {lr: .inf}", "optimizer.lr: inf is not allowed; allowed: a finite number"),
        ("optimizer: {lr: 1e40}", "optimizer.lr: 1e+40 is too large"),
        ("optimizer: {weight_decay: .inf}", "optimizer.weight_decay: inf is not allowed"),
        ("optimizer: {eps: .inf}", "optimizer.eps: inf is not allowed"),
        ("optimizer: {eps: .nan}", "optimizer.eps: nan is not allowed"),
        ("precision: {param: fp16, loss_scale: .inf}", "precision.loss_scale: inf is not allowed"),
        ("precision: {dynamic: {initial: .inf}}", "precision.dynamic.initial: inf is not allowed"),
        ("backend: {timeout_s: .inf}", "backend.timeout_s: inf is not allowed"),
    ],
)
def test_yaml_infinities_and_huge_numbers_are_plan_errors(tmp_path, text, expected):
    path = write(tmp_path, text + "\n")
    assert f"plan file {path}: {expected}" in plan_error(path)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"optimizer": {"lr": 2.0}}, "optimizer.lr: 2.0 is too large: an AdamW step"),
        ({"optimizer": {"name": "sgd", "lr": 20.0}}, "to 10 for sgd"),
        # Values that pass as numbers and train nothing (issue 53): 0 in fp32, or a run that
        # never finishes a step, or skips every one
        ({"optimizer": {"lr": 1e-300}}, "optimizer.lr: 1e-300 is too small: the update applies"),
        ({"optimizer": {"grad_clip": 1e-300}}, "optimizer.grad_clip: 1e-300 is not allowed"),
        ({"grad_accumulation": 2**64 + 1}, "grad_accumulation: 18446744073709551617 is not"),
        ({"precision": {"dynamic": {"hysteresis": 10**40}}}, "an integer >= 1 and <= 1000"),
        ({"overlap": {"prefetch": 2**64 + 1}}, "overlap.prefetch: 18446744073709551617 is not"),
        ({"units": {"min_mb": 2**64 + 1}}, "units.min_mb: 18446744073709551617 is not"),
        ({"overlap": {"max_inflight_mb": 1e40}}, "overlap.max_inflight_mb: 1e+40 is not"),
        ({"cost": {"compute_tflops": 1e308}}, "cost.compute_tflops: 1e+308 is not allowed"),
        ({"zero": {"world_size": 2**62}}, "zero.world_size: 4611686018427387904 is not"),
        ({"seed": -1}, "seed: -1 is not allowed"),
        ({"seed": 2**70}, "seed: 1180591620717411303424 is not allowed"),
        (
            {"optimizer": {"lr": 0.5, "weight_decay": 2.0}},
            "optimizer: lr 0.5 * weight_decay 2 = 1:",
        ),
        ({"optimizer": {"name": "sgd", "lr": 1.0, "weight_decay": 1.0}}, "lr * weight_decay < 1"),
        ({"optimizer": {"name": "sgd", "momentum": 1.0}}, "a finite number >= 0 and < 1"),
        ({"optimizer": {"eps": 1e-40}}, "optimizer.eps: 1e-40 is not allowed; allowed: a finite"),
        ({"optimizer": {"grad_clip": math.inf}}, "optimizer.grad_clip: inf is not allowed"),
        ({"precision": {"loss_scale": 2.0**40}}, "or a positive number from 1.18e-38 to 2^32"),
        ({"precision": {"dynamic": {"initial": 2.0**40}}}, "<= 4294967296"),
        (
            {"precision": {"dynamic": {"initial": 4, "min_scale": 8}}},
            "min_scale 8 is above initial",
        ),
        ({"backend": {"timeout_s": 1e9}}, "backend.timeout_s: 1000000000.0 is not allowed"),
    ],
)
def test_numbers_out_of_their_meaningful_range(data, expected):
    assert expected in plan_error(data)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # Values that pass as numbers and train nothing (issue 77, case 9): eps is inf in fp32
        # (no weight moves); a peak rate of 1e-300 is 0 there; a warmup longer than any run.
        ({"optimizer": {"eps": 1e300}}, "optimizer.eps: 1e+300 is not allowed; allowed: a "
         "finite number >= 1.18e-38 and <= 1"),
        ({"optimizer": {"schedule": {"name": "warmup_lr", "warmup_max_lr": 1e-300}}},
         "optimizer.schedule.warmup_max_lr: 1e-300 is not allowed; allowed: a finite number "
         ">= 1.18e-38"),
        ({"optimizer": {"schedule": {"warmup_steps": 10**15}}},
         "optimizer.schedule.warmup_steps: 1000000000000000 is not allowed; allowed: an "
         "integer >= 0 and <= 1000000000"),
        ({"optimizer": {"schedule": {"name": "warmup_lr", "warmup_num_steps": 10**15}}},
         "<= 1000000000"),
        ({"optimizer": {"schedule": {"name": "cosine", "total_steps": 10**15}}}, "<= 1000000000"),
        # (case 10) a collective timeout no healthy run meets: the range is said
        ({"backend": {"timeout_s": 1e-9}},
         "backend.timeout_s: 1e-09 is not allowed; allowed: a finite number >= 1 and <= 604800"),
    ],
)  # fmt: skip
def test_values_that_train_nothing_or_fail_at_launch_are_refused(data, expected):
    assert expected in plan_error(data)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('optimizer: {lr: "1e-3"}', "optimizer.lr: '1e-3' is a string (quoted), not a number; "
         "write the number without quotes: 1e-3"),
        ("grad_accumulation: '2'", "grad_accumulation: '2' is a string (quoted), not a number"),
        ('optimizer: {betas: ["0.9", 0.99]}', "optimizer.betas: '0.9' is a string (quoted)"),
        ('cost: {group_link_gbps: {tp: "400"}}', "cost.group_link_gbps: '400' is a string"),
        ('precision: {param: fp16, loss_scale: "1024"}', "precision.loss_scale: '1024' is a str"),
    ],
)  # fmt: skip
def test_quoted_numbers_are_refused_not_coerced(tmp_path, text, expected):
    """(issue 77, case 9) pydantic read ``lr: "1e-3"`` as 0.001 without a word."""
    assert expected in plan_error(write(tmp_path, text + "\n"))


def test_numbers_yaml_1_1_reads_as_strings_are_numbers(tmp_path):
    """PyYAML reads ``1e-3`` (no dot) as a string; a plan reads it as YAML 1.2 does, a float,
    in files and in --set items alike, so that refusing quoted numbers refuses only those."""
    plan = load_plan(write(tmp_path, "optimizer: {lr: 1e-3, eps: 1E-6}\ngrad_accumulation: 2\n"))
    assert (plan.optimizer.lr, plan.optimizer.eps, plan.grad_accumulation) == (1e-3, 1e-6, 2)
    assert load_plan({}, ["optimizer.lr=3e-4"]).optimizer.lr == 3e-4
    assert load_plan({"precision": {"loss_scale": "dynamic"}}).precision.loss_scale == "dynamic"


def test_numbers_at_the_edges_of_their_ranges_are_accepted(tmp_path):
    assert load_plan({"optimizer": {"lr": 1.0, "weight_decay": 0.5}}).optimizer.lr == 1.0
    assert load_plan({"optimizer": {"name": "sgd", "lr": 10, "momentum": 0.99}}).optimizer.lr == 10
    scale = load_plan(write(tmp_path, "precision: {param: fp16, loss_scale: 1e4}\n")).precision
    assert scale.loss_scale == 1e4 and scale.scaling == "static"  # YAML reads 1e4 as a string
    assert load_plan({"precision": {"dynamic": {"initial": 2.0**32}}}).precision.dynamic.initial


# --- YAML that no plan may hold --------------------------------------------------------------


def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    path = write(tmp_path, "optimizer:\n  lr: 1.0e-3\n  eps: 1.0e-8\n  lr: 1.0\n")
    message = plan_error(path)
    assert "line 4: duplicate key 'lr' (first at line 2)" in message and str(path) in message
    top = plan_error(write(tmp_path, "zero: {stage: 3}\nseed: 1\nzero: {stage: 1}\n", "top.yaml"))
    assert "line 3: duplicate key 'zero' (first at line 1)" in top


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    text = "workload_args:\n  base: &b {n: 1, m: 2}\n  other: {<<: *b, n: 3}\n"
    assert load_plan(write(tmp_path, text)).workload_args["other"] == {"n": 3, "m": 2}


def _deep_list(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def test_deeply_nested_yaml_is_one_line_plan_error(tmp_path):
    path = write(tmp_path, "workload_args: {x: " + "[" * 10000 + "]" * 10000 + "}\n")
    message = plan_error(path)
    assert "line 1: nested deeper than 100 levels" in message and "\n" not in message


@pytest.mark.parametrize("section", ["workload_args", "units"])
def test_deeply_nested_dict_is_one_line_plan_error(section):
    data = (
        {"workload_args": {"x": _deep_list(10000)}}
        if section == "workload_args"
        else {"units": {"classes": _deep_list(10000)}}
    )
    message = plan_error(data)
    assert f"plan: {section}." in message and "nested deeper than 100 levels" in message
    assert "\n" not in message


def test_a_yaml_alias_that_contains_itself_is_refused(tmp_path):
    message = plan_error(write(tmp_path, "workload_args: &a {x: *a}\n"))
    assert "workload_args.x.x" in message and "contains itself" in message


def test_yaml_aliases_that_expand_to_billions_of_values_are_refused(tmp_path):
    text = "workload_args:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 10)
    )
    assert "more than 1,000,000 values" in plan_error(write(tmp_path, text))


@pytest.mark.parametrize("as_path", [False, True])
def test_a_nul_byte_in_the_plan_path(tmp_path, as_path):
    src = str(tmp_path / "pl\0an.yaml")
    message = plan_error(Path(src) if as_path else src)
    assert "a path cannot contain a NUL byte" in message and "\0" not in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "field", ["offload.nvme_path", "dumps.dir", "cost.calibration"]
)  # fmt: skip
def test_a_nul_byte_in_a_path_field(tmp_path, field):
    section, name = field.split(".")
    extra = "  optimizer: nvme\n" if section == "offload" else ""
    path = write(tmp_path, f'{section}:\n{extra}  {name}: "a\\0b"\nzero: {{stage: 3}}\n')
    message = plan_error(path)
    assert f"{field}: 'a\\x00b' contains a NUL byte" in message and "\n" not in message


# --- passes listed that would do nothing -----------------------------------------------------


@pytest.mark.parametrize(
    ("passes", "expected"),
    [
        (
            ["partition", "recompute", "shard", "optimizer"],
            "passes[1]: 'recompute' would do nothing",
        ),
        (
            ["partition", "shard", "precision", "optimizer"],
            "passes[2]: 'precision' would do nothing",
        ),
        (["partition", "shard", "optimizer", "offload"], "passes[3]: 'offload' would do nothing"),
    ],
)
def test_a_listed_pass_with_nothing_to_do_is_an_error(passes, expected):
    assert expected in pipeline_error({"passes": passes})


@pytest.mark.parametrize("workload", ["workload", "a:b:c", "my-module:fn", ":fn", "mod:"])
def test_bad_workload_string(workload):
    message = plan_error({"workload": workload})
    assert "workload" in message and "'module:function'" in message


def test_good_workload_strings():
    assert load_plan({"workload": "pkg.mod:make"}).workload == "pkg.mod:make"


def test_plan_error_is_a_zerocc_error_and_a_value_error():
    assert issubclass(PlanError, ZeroccError) and issubclass(PlanError, ValueError)
    with pytest.raises(PlanError):
        load_plan(42)


# --- schema ----------------------------------------------------------------------------------


def test_schema_describes_every_property():
    schema = plan_json_schema()
    models = [schema, *schema["$defs"].values()]
    assert len(models) == 21  # Plan and the twenty models under it
    for model in models:
        assert model["additionalProperties"] is False
        for name, prop in model["properties"].items():
            assert prop.get("description"), f"{model['title']}.{name} has no description"


def test_schema_lists_literal_choices():
    defs = plan_json_schema()["$defs"]
    assert defs["ZeroConfig"]["properties"]["stage"]["enum"] == [0, 1, 2, 3]
    assert defs["BackendConfig"]["properties"]["device"]["enum"] == ["auto", "cpu", "cuda"]
    offload = defs["OffloadConfig"]["properties"]
    assert offload["optimizer"]["enum"] == offload["params"]["enum"] == ["none", "cpu", "nvme"]


@pytest.mark.parametrize(
    "data, path",
    [
        ({"optimizer": {"lr": True}}, "optimizer.lr"),
        ({"zero": {"world_size": True}}, "zero.world_size"),
        ({"overlap": {"prefetch": False}}, "overlap.prefetch"),
        ({"backend": {"timeout_s": True}}, "backend.timeout_s"),
    ],
)
def test_a_boolean_is_not_a_number(data, path):
    message = plan_error(data)  # YAML `lr: true` would otherwise read as 1.0
    assert path in message and ("True" in message or "False" in message)


def test_the_fields_ranks_agree_on_are_all_but_the_host_local_ones():
    from zerocc.compiler.plan import HOST_LOCAL

    plan = Plan.model_validate(
        {
            "optimizer": {"lr": 0.02, "schedule": {"name": "cosine", "total_steps": 9}},
            "offload": {"optimizer": "nvme", "nvme_path": "/local/disk"},
            "checkpoint": {"dir": "/mnt/a", "every": 5},
            "workload_args": {"data": "/host/data", "tokenizer": object()},  # any object
        }
    )
    lines = plan.shared_lines().splitlines()
    assert "optimizer.lr: 0.02" in lines and "optimizer.schedule.total_steps: 9" in lines
    assert "offload.optimizer: 'nvme'" in lines and "checkpoint.every: 5" in lines
    assert not [line for line in lines if line.split(":")[0].startswith(tuple(HOST_LOCAL))]
    assert "/local/disk" not in plan.shared_lines() and "/host/data" not in plan.shared_lines()
