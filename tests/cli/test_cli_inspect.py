"""`zerocc inspect` and `zerocc estimate` on the example plans (nothing is launched)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pydot
import pytest

from zerocc.cli.main import main
from zerocc.ir.quantities import human_bytes

pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated - use:DeprecationWarning")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gpt"
ZERO3 = str(EXAMPLES / "zero3.yaml")
BF16 = str(EXAMPLES / "zero3-bf16.yaml")
UNITS = ["root", "transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"]


def run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_command_ends_its_process_with_the_report_out_and_its_status(tmp_path):
    """`python -m zerocc estimate` ends the process without tearing down what it compiled: what
    it printed is all there (the JSON parses) and its status is the command's; a command that
    fails (a plan that is not there) says so with status 2."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES)}
    estimate = [sys.executable, "-m", "zerocc", "estimate"]
    done = subprocess.run(
        [*estimate, ZERO3, "--json", "--world-size", "8"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["world_size"] == 8
    missing = str(tmp_path / "none.yaml")
    failed = subprocess.run([*estimate, missing], capture_output=True, text=True, env=env)
    assert failed.returncode == 2 and "none.yaml: not found" in failed.stderr


def test_pass_table_names_each_pass_and_what_it_inserted(capsys):
    out = run(capsys, "inspect", ZERO3, "--world-size", "4")
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    assert ["capture", "partition", "shard", "optimizer"] == [
        name for name in rows if name in ("capture", "partition", "shard", "optimizer")
    ]
    # 5 units, gathered and freed in forward and backward; one reduce-scatter per unit.
    assert "all_gather_start ×10" in rows["shard"] and "free ×10" in rows["shard"]
    assert "reduce_scatter_start ×5" in rows["shard"]
    assert "adamw_ ×5" in rows["optimizer"] and "4 ranks" in out


def test_print_after_shows_each_units_collectives_in_order(capsys):
    out = run(capsys, "inspect", ZERO3, "--print-after", "shard")
    assert out.startswith("# Constructed by pass 'shard'")
    lines = out.splitlines()
    for unit in UNITS:
        ops = [
            re.search(r"zerocc\.(\w+)\(", line).group(1) + ("*" if "role=gathered" in line else "")
            for line in lines
            if f"unit={unit} " in line and "zerocc." in line
        ]
        gathers = [op for op in ops if op in ("all_gather_start", "wait*", "free")]
        assert gathers == ["all_gather_start", "wait*", "free"] * 2, (unit, ops)
        reduce = ops.index("reduce_scatter_start")
        assert ops[reduce - 1] == "pack" and ops[reduce + 1] == "wait", (unit, ops)


def test_print_before_is_the_previous_passes_program(capsys):
    out = run(capsys, "inspect", ZERO3, "--print-before", "shard")
    assert out.startswith("# Constructed by pass 'partition'") and "zerocc." not in out


def test_diff_shows_only_what_the_pass_changed(capsys):
    assert run(capsys, "inspect", ZERO3, "--diff", "partition") == ""  # an analysis pass
    diff = run(capsys, "inspect", BF16, "--diff", "precision").splitlines()
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    # Per-parameter casts after the gathers are gone; gathers move bf16.
    assert any("aten._to_copy" in line for line in removed)
    assert not any("aten._to_copy(view" in line for line in added)
    assert any("all_gather_start" in line and "bf16[" in line for line in added)
    context = [line for line in diff if line.startswith(" ")]
    assert len(context) < len(removed) + len(added)  # a diff, not the whole program


def test_dot_output_parses_with_a_cluster_per_unit(capsys):
    out = run(capsys, "inspect", ZERO3, "--print-after", "optimizer", "--format", "dot")
    (graph,) = pydot.graph_from_dot_data(out)
    clusters = {g.get_name().strip('"') for g in graph.get_subgraphs()}
    assert {f"cluster_{u.replace('.', '_')}" for u in UNITS} <= clusters


def test_json_and_unit_filter(capsys):
    out = run(capsys, "inspect", ZERO3, "--print-after", "optimizer", "--format", "json",
              "--unit", "transformer.h.2")  # fmt: skip
    nodes = [n for n in json.loads(out)["nodes"] if n["kind"] != "output"]
    assert nodes and {n["unit"] for n in nodes} == {"transformer.h.2"}
    assert {"zerocc.all_gather_start", "zerocc.adamw_"} <= {n["op"] for n in nodes}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--diff", "nope"], "no pass 'nope' in this pass list; passes: partition, shard"),
        (["--unit", "h.9"], "--unit 'h.9': no such unit; units: root, transformer.h.0"),
    ],
)
def test_bad_pass_or_unit_is_a_clear_error(capsys, argv, message):
    assert main(["inspect", ZERO3, *argv]) == 2
    assert message in capsys.readouterr().err


def test_estimate_table_shows_the_four_stages(capsys):
    out = run(capsys, "estimate", ZERO3, "--world-size", "8", "--table")
    header = next(line for line in out.splitlines() if line.startswith("per rank"))
    assert header.split()[2:] == ["stage", "0", "stage", "1", "stage", "2", "stage", "3"]
    assert "gathered units (peak)" in out and "reduce_scatter / step" in out
    figures = json.loads(run(capsys, "estimate", ZERO3, "--world-size", "8", "--table", "--json"))
    states = [f["model_states"]["total"] for f in figures]
    assert states == sorted(states, reverse=True) and states[0] > 4 * states[3]


def test_estimate_shows_gloos_buffers_for_cpu_ranks_only(capsys):
    """CPU ranks' collectives run on gloo, whose buffers are a row of their own (none at stage
    0: an all-reduce works in place); a GPU's NCCL has none, and the row is left out."""
    on_cpu = run(capsys, "estimate", ZERO3, "--world-size", "4", "--table", "--device", "cpu")
    row = next(line for line in on_cpu.splitlines() if line.startswith("gloo buffers (peak)"))
    assert row.split()[3] == "0B" and all(v != "0B" for v in row.split()[4:])
    on_gpu = run(capsys, "estimate", ZERO3, "--world-size", "4", "--device", "cuda")
    assert "gloo buffers" not in on_gpu
    cpu = ("--device", "cpu")
    figures = json.loads(run(capsys, "estimate", ZERO3, "--world-size", "4", "--json", *cpu))
    assert figures["peak"]["comm"] > 0


def test_estimate_counts_in_memory_checkpoints_where_the_plan_keeps_them(capsys):
    """`checkpoint.in_memory` keeps two snapshots of each rank's state in /dev/shm (host
    memory): a row of its own, twice the snapshot (its size against a rank's state dict:
    tests/runtime/test_offload.py), said only where the plan keeps them."""
    figures = json.loads(run(capsys, "estimate", ZERO3, "--world-size", "2", "--json"))
    kept = run(capsys, "estimate", ZERO3, "--world-size", "2", "--set", "checkpoint.in_memory=true")
    row = next(line for line in kept.splitlines() if "in-memory checkpoints" in line)
    assert row.split()[2] == human_bytes(2 * figures["snapshot_bytes"])
    assert human_bytes(4 * figures["snapshot_bytes"]) + " over several machines" in row
    assert "in-memory checkpoints" not in run(capsys, "estimate", ZERO3, "--world-size", "2")


def test_estimate_of_hybrid_sharding_draws_the_mesh_and_bytes_per_group(capsys):
    hsdp = str(EXAMPLES / "zero3-hsdp.yaml")
    out = run(capsys, "estimate", hsdp, "--world-size", "8")
    assert "mesh: 8 ranks = 2 replicas × 4 shards" in out
    assert re.search(r"^  all_reduce \(replicate\) +[\d.]+[KM]iB$", out, re.M), out
    figures = json.loads(run(capsys, "estimate", hsdp, "--world-size", "8", "--table", "--json"))
    # stage 0 replicates everything (no replica groups); stages 1-3 shard over 4 ranks, not 8
    plain = json.loads(run(capsys, "estimate", ZERO3, "--world-size", "4", "--table", "--json"))
    assert [f["model_states"]["total"] for f in figures[1:]] == [
        f["model_states"]["total"] for f in plain[1:]
    ]
    assert main(["estimate", hsdp, "--world-size", "5"]) == 2
    assert "zero.replicate: 2 does not divide the world size 5" in capsys.readouterr().err


def test_estimate_predicts_the_step_time_with_the_flags_rates(capsys, tmp_path):
    from zerocc.cost.rates import DeviceRates

    flags = ["--link-gbps", "400", "--latency-us", "2", "--device", "cuda"]
    fast = json.loads(run(capsys, "estimate", ZERO3, "--world-size", "8", "--json", *flags))
    timing = fast["timing"]
    assert timing["rate_sources"]["link_bytes_per_s"] == "flags"
    assert timing["rates"]["link_bytes_per_s"] == 50e9 and timing["rates"]["latency_s"] == 2e-6
    assert timing["step_ms"] >= timing["compute_ms"] > 0 and timing["comm_ms"] > 0
    assert 0 <= timing["exposed_comm_ms"] <= timing["comm_ms"]
    assert timing["exposed_comm_pct"] == pytest.approx(
        100 * timing["exposed_comm_ms"] / timing["step_ms"]
    )
    slow = DeviceRates.defaults("cuda").replace("test", link_bytes_per_s=1e6)
    slow.save(tmp_path / "slow.json")
    out = run(capsys, "estimate", ZERO3, "--world-size", "8", "--calibration",
              str(tmp_path / "slow.json"))  # fmt: skip
    step = re.search(r"^  step +([\d.]+) (ms|s)$", out, re.M)
    assert step and float(step[1]) * (1e3 if step[2] == "s" else 1) > fast["timing"]["step_ms"]
    assert re.search(r"exposed communication +[\d.]+ m?s +\(\d+% of the step\)", out)
    assert "peak memory" in out and "rates (cuda calibration)" in out
    assert "warning: predicted times" not in out  # calibrated


def test_estimate_of_an_offload_plan_weighs_host_memory_against_its_states(capsys, tmp_path):
    """The host memory offload holds at its peak, states and buffers, over the states; with
    every gradient shard in host buffers, the way to two units' of them."""
    offload = EXAMPLES / "zero3-offload.yaml"
    kept = tmp_path / "kept.yaml"
    kept.write_text(offload.read_text().replace("ratio: 0.5", "ratio: 1.0\n  grads: device"))
    pattern = r"= host memory \(peak\)\s+(\S+)\s+\((\d\.\d\d)× the states there(.*)\)"
    figures = {}
    for plan in (offload, kept):
        out = run(capsys, "estimate", "--device", "cuda", str(plan))
        held, ratio, hint = re.search(pattern, out).groups()
        figures[plan.stem] = float(ratio), hint
    ratio, hint = figures["zero3-offload"]
    assert ratio > 1.1 and "offload.grads: device keeps two units' gradients there" in hint
    ratio, hint = figures["kept"]
    assert ratio < figures["zero3-offload"][0] and hint == ""


def test_estimate_warns_when_its_rates_are_defaults(capsys):
    out = run(capsys, "estimate", ZERO3, "--world-size", "2")
    assert "warning: predicted times use the built-in" in out and "zerocc profile" in out
    table = run(capsys, "estimate", ZERO3, "--world-size", "2", "--table")
    assert "warning: predicted times use the built-in" in table


def test_estimate_table_has_a_step_time_row(capsys):
    out = run(capsys, "estimate", ZERO3, "--world-size", "4", "--table", "--link-gbps", "10")
    rows = {line[:26].strip(): line[26:].split() for line in out.splitlines()}
    assert len(rows["step time"]) == 8 and len(rows["exposed communication"]) == 8  # 4 × "n ms"
    assert "link from the flags" in out


@pytest.mark.parametrize(
    ("backend", "compiled"), [("inductor-whole", "whole"), ("inductor", "region_")]
)
def test_lowered_shows_what_inductor_compiled_and_writes_its_code(
    capsys, tmp_path, backend, compiled
):
    plan = tmp_path / "inductor.yaml"
    plan.write_text(
        'workload: "workload:workload"\n'
        "workload_args: {n_layer: 2, n_embd: 32, n_head: 2, block_size: 16, batch_size: 2}\n"
        f"zero: {{stage: 3}}\nunits: {{classes: [Block]}}\nbackend: {{name: {backend}}}\n"
    )
    out = run(capsys, "inspect", str(plan), "--world-size", "2", "--lowered", str(tmp_path / "out"))
    assert out.startswith(f"backend {backend}:")
    table = out[out.index("region ") :].splitlines()
    names = [row.split()[0] for row in table[1:] if row.startswith(compiled)]
    assert names and all(row.endswith("compiled") for row in table[1 : 1 + len(names)])
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert written == {"regions.txt", *(f"{name}.py" for name in names)}


def test_lowered_on_the_eager_backend_says_nothing_is_generated(capsys):
    out = run(capsys, "inspect", ZERO3, "--lowered")
    assert "backend eager:" in out and "nothing generated" in out


def _pipeline_plan(tmp_path, pipeline: str = "{schedule: 1f1b, microbatches: 4}") -> str:
    plan = tmp_path / "pp.yaml"
    plan.write_text(
        'workload: "workload:workload"\n'
        "workload_args: {n_layer: 8, n_embd: 32, n_head: 2, block_size: 16, batch_size: 8,\n"
        "                vocab_size: 2048}\n"
        f"zero: {{stage: 3}}\nunits: {{classes: [Block]}}\nparallel: {{pp: 2}}\n"
        f"pipeline: {pipeline}\n"
    )
    return str(plan)


def test_inspect_of_a_pipeline_plan_shows_its_cut_and_schedule(capsys, tmp_path):
    out = run(capsys, "inspect", _pipeline_plan(tmp_path), "--world-size", "4")
    assert out.startswith("pipeline: 2 stages on 2 pipeline ranks")
    assert "4 micro-batches of [2, 16], [2, 16]" in out  # the rank's batch of 8, cut in 4
    assert "2 pipeline stages' ranks × 2 shards" in out
    assert "split (pipeline.split: auto)" in out and "head and loss" in out
    assert re.search(r"-> stage 1: add_\d+ \[2, 16, 32\]", out)  # the residual stream
    assert "tied transformer.wte.weight: held by stages [0, 1]" in out
    assert "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3" in out and "bubble 20.0%" in out
    assert "`zerocc estimate PLAN` predicts each rank's memory" in out


def test_inspect_schedule_prints_a_pipelines_schedule_alone(capsys, tmp_path):
    out = run(capsys, "inspect", _pipeline_plan(tmp_path), "--world-size", "2", "--schedule")
    assert out.splitlines()[0] == "rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    assert out.splitlines()[-1].startswith("1f1b: 2 ranks × 1 stage(s), 4 micro-batches")
    assert main(["inspect", str(EXAMPLES / "zero3.yaml"), "--schedule"]) == 2
    assert "--schedule: a plan without a pipeline has none" in capsys.readouterr().err


def test_inspect_of_a_pipeline_split_where_the_plan_says(capsys, tmp_path):
    plan = _pipeline_plan(tmp_path, "{split: [transformer.h.6]}")
    out = run(capsys, "inspect", plan, "--world-size", "2")
    assert "split (pipeline.split)\n" in out
    assert "stage 0: units transformer.h.0 .. transformer.h.5 (6)" in out
    bad = _pipeline_plan(tmp_path, "{split: [transformer.h.9]}")
    assert main(["inspect", bad]) == 2
    assert "pipeline.split: ['transformer.h.9'] are not units" in capsys.readouterr().err


def test_what_a_pipeline_plan_cannot_do_yet_is_refused_before_any_rank_starts(capsys, tmp_path):
    plan = _pipeline_plan(tmp_path)
    assert main(["estimate", plan, "--world-size", "4", "--table"]) == 2
    assert "--table: not for a pipeline plan yet" in capsys.readouterr().err
    assert main(["inspect", plan, "--print-after", "shard"]) == 2
    assert "--print-after: not for a pipeline plan yet" in capsys.readouterr().err


def test_estimate_says_whose_rates_it_uses(capsys):
    """On a machine without a GPU a plan on `backend.device: auto` is estimated with CPU rates,
    and the command says so and how to get a GPU's; with --device cuda the warning names the
    H100 figures, not this machine."""
    import torch

    plan = str(Path(__file__).resolve().parents[2] / "examples" / "gpt" / "zero3.yaml")
    assert main(["estimate", plan]) == 0
    captured = capsys.readouterr()
    if torch.cuda.is_available():
        assert "cpu rates" not in captured.err  # (auto is this machine's GPU there)
    else:
        assert "cpu rates (backend.device: auto, and this machine has no GPU)" in captured.err
        assert "a typical CPU's" in captured.out
    assert main(["estimate", plan, "--device", "cuda"]) == 0
    captured = capsys.readouterr()
    assert "cpu rates" not in captured.err and "an H100's datasheet figures" in captured.out


def test_inspect_and_estimate_default_to_the_fewest_ranks_the_layout_takes(capsys):
    """Without --world-size they simulated 2 ranks, which a layout of more refused (the
    DeepSeek-V3 example's ep 64 until given --world-size 1024, its header saying it is for
    inspect): now the fewest ranks the layout takes, as `zerocc train`'s --nproc."""
    out = run(capsys, "inspect", ZERO3, "--set", "zero.replicate=3")
    assert "ZeRO stage 3, 6 ranks, 5 units" in out


def test_estimate_says_when_the_peak_does_not_fit_the_gpu_it_times(capsys):
    """`zerocc estimate --device cuda` of the DeepSeek-V3 example printed `peak 676.6GiB` and
    nothing more: a peak over the 80 GiB of the GPU the cuda rates describe says so."""
    plan = str(EXAMPLES / "7b.yaml")
    out = run(capsys, "estimate", plan, "--device", "cuda", "--set", "zero.stage=0")
    assert re.search(r"peak memory +110\.\dGiB\n  does not fit: the peak is 1\.4x an H100's 80 "
                     r"GiB per rank \(the cuda rates' GPU\); `zerocc plan auto PLAN --world-size "
                     r"2 --device cuda` searches for a plan that fits", out)  # fmt: skip
    fits = run(capsys, "estimate", plan, "--device", "cuda", "--world-size", "8")
    assert "peak memory" in fits and "does not fit" not in fits
