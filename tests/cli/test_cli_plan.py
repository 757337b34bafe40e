"""Tests of the `zerocc plan` commands (zerocc/cli/plan.py)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tracked import tracked

from zerocc.cli.main import main
from zerocc.errors import PlanWarning

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"


@pytest.mark.parametrize(
    "name",
    ["zero0.yaml", "zero1.yaml", "zero2.yaml", "zero3.yaml", "zero3-bf16.yaml",
     "zero3-offload.yaml"],
)  # fmt: skip
def test_plan_check_accepts_each_example(capsys, name):
    path = EXAMPLES / name
    assert main(["plan", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: ok (stage {name[4]}," in out
    if "offload" in name:
        assert (
            "partition -> recompute -> shard -> precision -> optimizer -> overlap -> offload" in out
        )
    elif "bf16" in name:
        assert "partition -> shard -> precision -> optimizer" in out
        assert "bf16 compute, fp32 reduce, fp32 master, no loss scaling" in out
    else:
        assert "partition -> shard -> optimizer" in out and "fp32," in out


def test_plan_check_rejects_a_bad_plan(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("zero:\n  stage: 4\n")
    assert main(["plan", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert str(path) in captured.err and "zero.stage" in captured.err
    assert "allowed values: 0, 1, 2, 3" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("command", ["plan check", "train"])
def test_a_missing_nvme_folder_fails_before_any_rank_starts(tmp_path, capsys, command):
    path = tmp_path / "nvme.yaml"
    path.write_text(f"offload: {{optimizer: nvme, nvme_path: {tmp_path / 'absent'}}}\n")
    assert main([*command.split(), str(path)]) == 2
    err = capsys.readouterr().err
    assert "offload.nvme_path" in err and "does not exist" in err and "Traceback" not in err


def test_plan_check_missing_file(tmp_path, capsys):
    assert main(["plan", "check", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_plan_schema_prints_json(capsys):
    assert main(["plan", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Plan" and "zero" in schema["properties"]


@pytest.mark.parametrize("argv", [[], ["plan"]])
def test_no_command_prints_help(capsys, argv):
    assert main(argv) == 0
    assert "usage: zerocc" in capsys.readouterr().out


def test_help_names_every_plan_command(capsys):
    """`zerocc --help` said "check a plan file or print the plan schema": no import, no auto."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "plan check a plan file, search for the fastest plan that fits (auto), convert a "
        "DeepSpeed config (import), or print the plan schema" in out
    )


def test_plan_check_accepts_every_example_plan(capsys):
    """Every example plan git tracks (not a zero3.auto.yaml a user's plan auto left there)."""
    plans = tracked(EXAMPLES.parent, "**/*.yaml")
    assert {EXAMPLES / "zero3.yaml", EXAMPLES.parent / "torchrun" / "plan.yaml"} <= set(plans)
    for path in plans:
        assert main(["plan", "check", str(path)]) == 0, capsys.readouterr().err
        assert f"{path}: ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("passes", "expected"),
    [
        ("[shard, partition]", "passes[0]: 'shard' requires 'units' (produced by partition)"),
        ("[partition, partition, shard, optimizer]", "passes[1]: 'partition' is listed twice"),
        ("[partition, shard]", "passes: a training step needs 'optimizer_update'"),
        (
            "[partition, shrad, optimizer]",
            "passes[1]: unknown pass 'shrad' (did you mean 'shard'?)",
        ),
        ("[partition, shard, optimizer, overlap, optimizer]", "passes[4]: 'optimizer' is listed"),
    ],
)
def test_plan_check_checks_the_passes(tmp_path, capsys, passes, expected):
    path = tmp_path / "passes.yaml"
    path.write_text(f"passes: {passes}\n")
    assert main(["plan", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"zerocc: error: plan file {path}: {expected}" in err
    allowed = "partition, recompute, shard, precision, optimizer, overlap, offload"
    assert allowed in err or "twice" in err  # the allowed order (or names) comes with the error
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "text",
    [
        'offload: {optimizer: nvme, nvme_path: "a\\0b"}',
        'dumps: {dir: "a\\0b"}',
        'cost: {calibration: "a\\0b"}',
        "workload_args: {x: " + "[" * 10000 + "]" * 10000 + "}",
        "optimizer: {lr: .inf}",
        "optimizer:\n  lr: 1.0e-3\n  lr: 1.0e-2",
    ],
    ids=["nvme_path", "dumps.dir", "calibration", "nested", "inf", "duplicate"],
)
def test_plan_check_reports_bad_data_in_one_line(tmp_path, capsys, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    assert main(["plan", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerocc: error: plan file {path}: ") and err.count("\n") == 1


def test_plan_check_of_a_path_with_a_nul_byte(capsys):
    assert main(["plan", "check", "plan\0.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == "zerocc: error: plan file 'plan\\x00.yaml': a path cannot contain a NUL byte\n"


def test_version_names_zerocc_and_torch(capsys):
    import torch

    import zerocc

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert f"zerocc {zerocc.__version__} (torch {torch.__version__}" in capsys.readouterr().out


def test_set_overrides_plan_fields_checked_as_the_files_own(capsys):
    plan = str(EXAMPLES / "zero3.yaml")
    assert main(["plan", "check", plan, "--set", "zero.stage=1", "--set", "optimizer.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert "ok (stage 1," in out and "adamw lr 0.0003" in out
    assert main(["plan", "check", plan, "--set", "zero.stage=5"]) == 2
    err = capsys.readouterr().err
    assert "with --set zero.stage=5: zero.stage: 5 is not allowed; allowed values: 0, 1" in err
    assert main(["plan", "check", plan, "--set", "optimiser.lr=1"]) == 2
    assert "unknown field 'optimiser' (did you mean 'optimizer'?)" in capsys.readouterr().err
    assert main(["plan", "check", plan, "--set", "zero.stage"]) == 2
    assert "--set zero.stage: expected KEY=VALUE" in capsys.readouterr().err
    assert main(["plan", "check", plan, "--backend", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_estimate_and_inspect_take_the_overrides(capsys):
    plan = str(EXAMPLES / "zero3.yaml")
    assert main(["estimate", plan, "--set", "zero.stage=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage"] == 2
    assert main(["inspect", plan, "--set", "zero.stage=0"]) == 0
    assert "ZeRO stage 0" in capsys.readouterr().out


def test_plan_check_imports_the_workload_before_any_rank_would(tmp_path, capsys):
    """A plan copied away from its workload's module fails `plan check` (and so `train`
    before launching), naming the module and where it looked; a workload given as a file
    path, relative to the plan's folder, is found and its arguments checked."""
    text = (EXAMPLES / "zero3.yaml").read_text()
    copied = tmp_path / "copied.yaml"
    copied.write_text(text)
    # (a process of its own: the tests put the example's folder on sys.path)
    check = [sys.executable, "-m", "zerocc", "plan", "check", str(copied)]
    run = subprocess.run(check, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "workload: cannot import module 'workload'" in run.stderr
    plans = tmp_path / "plans"
    plans.mkdir()
    by_file = plans / "by_file.yaml"
    relative = os.path.relpath(EXAMPLES / "workload.py", plans)
    by_file.write_text(text.replace('"workload:workload"', f'"{relative}:workload"'))
    assert main(["plan", "check", str(by_file)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["inspect", str(by_file)]) == 0
    assert "ZeRO stage 3" in capsys.readouterr().out
    wrong_args = plans / "wrong_args.yaml"
    wrong_args.write_text(by_file.read_text().replace("n_layer:", "n_layers:"))
    assert main(["plan", "check", str(wrong_args)]) == 2
    assert "workload_args: cannot call" in capsys.readouterr().err


def test_plan_check_checks_what_the_plan_names_in_the_model(capsys):
    """The workload's model is built and the plan's units and tensor-parallel layers looked up
    in it: `units.classes: [Blok]` was "ok" (issue 50), and `train` found it after launching
    every rank."""
    plan = str(EXAMPLES / "zero3.yaml")
    assert main(["plan", "check", plan]) == 0
    assert "; model GPT, 808,704 parameters, 5 units" in capsys.readouterr().out
    assert main(["plan", "check", plan, "--set", "units.classes=[Blok]"]) == 2
    err = capsys.readouterr().err
    assert "units.classes: no module of class 'Blok' in the model; its classes are: Block" in err
    assert main(["plan", "check", plan, "--set", "units.modules=[transformer.x.*]"]) == 2
    assert "units.modules: pattern 'transformer.x.*' matches no module" in capsys.readouterr().err
    tp = str(EXAMPLES / "zero3-tp.yaml")
    layers = "parallel.tp_layers={transformer.h.*.attn.q_proj: colwise}"
    assert main(["plan", "check", tp, "--set", layers]) == 2
    assert "matches no module of the model" in capsys.readouterr().err
    # expert parallelism of a dense model
    assert main(["plan", "check", plan, "--set", "parallel.ep=2"]) == 2
    assert "this model has no experts module" in capsys.readouterr().err


# --- what can be known before any rank starts (issue 77, cases 5, 10 and 11) ---------------


@pytest.mark.parametrize("command", ["plan check", "train"])
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["units.keep_gathered=['[']"],
         "units.keep_gathered: pattern '[' matches no unit; units are: root, transformer.h.0"),
        (["parallel.pp=2", "pipeline.microbatches=3"],
         "pipeline.microbatches: 3 micro-batches cut each batch tensor along its first "
         "dimension, which must be one size for all and divide by 3; the batch's tensors are "
         "[[8, 64], [8, 64]]"),
        (["dumps.dir=/proc/self"],
         "dumps.dir: /proc/self: dumps cannot be written there (No such file or directory)"),
        (["cost.calibration=/etc/passwd"],
         "cost.calibration: calibration file /etc/passwd: not a zerocc calibration"),
        (["cost.calibration=/"], "cost.calibration: calibration file /: cannot be read: Is a "
         "directory"),
    ],
    ids=["keep_gathered", "microbatches", "dumps.dir", "calibration", "calibration-folder"],
)  # fmt: skip
def test_what_failed_after_launch_fails_before_any_rank_starts(capsys, command, overrides,
                                                               expected):  # fmt: skip
    """Refused 9 s into `zerocc train` by every rank (keep_gathered, micro-batches), or by rank
    0 alone with a traceback (dumps.dir, cost.calibration): now by `plan check`, and by
    `train` before it launches any rank (its preflight runs the same checks)."""
    plan = str(EXAMPLES / "zero3.yaml")
    sets = [item for o in overrides for item in ("--set", o)]
    argv = [*command.split(), plan, *sets] + (["--nproc", "2"] if command == "train" else [])
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and "step" not in captured.out


def test_train_dump_flag_is_checked_before_any_rank_starts(capsys):
    plan = str(EXAMPLES / "zero3.yaml")
    assert main(["train", plan, "--nproc", "2", "--dump", "/proc/self/x"]) == 2
    assert "--dump: /proc/self/x: dumps cannot be written there" in capsys.readouterr().err


def test_keep_gathered_and_microbatches_that_fit_pass(capsys):
    plan = str(EXAMPLES / "zero3.yaml")
    assert main(["plan", "check", plan, "--set", "units.keep_gathered=[transformer.h.*]"]) == 0
    assert main(["plan", "check", str(EXAMPLES / "zero3-pp.yaml")]) == 0
    pp = ["--set", "parallel.pp=2", "--set", "pipeline.microbatches=8"]
    assert main(["plan", "check", plan, *pp]) == 0


def test_a_schedule_longer_than_the_run_is_warned_of(capsys):
    """(case 9) every field in range, and the run's rates all within a millionth of 0."""
    from zerocc.cli.plan import warn_if_the_run_trains_nothing
    from zerocc.compiler.plan import load_plan

    plan = load_plan({"optimizer": {"schedule": {"warmup_steps": 10**9}}})
    with pytest.warns(PlanWarning, match=r"over its 100 step\(s\) this run's learning rate "
                      r"reaches at most 9.9e-11, under a millionth of the schedule's peak 0.001 "
                      r"\(constant: warmup_steps 1000000000\)"):  # fmt: skip
        warn_if_the_run_trains_nothing(plan, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_the_run_trains_nothing(plan.model_copy(update={"optimizer": load_plan(
            {"optimizer": {"schedule": {"warmup_steps": 10}}}).optimizer}), 100)  # fmt: skip
        slow_log_warmup = {"name": "warmup_lr", "warmup_num_steps": 10**9}  # 2e-4 at step 99
        slow = load_plan({"optimizer": {"schedule": slow_log_warmup}})
        warn_if_the_run_trains_nothing(slow, 100)
