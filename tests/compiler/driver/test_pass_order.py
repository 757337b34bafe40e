"""One source of pass order: the default pass list is derived from the pass specs (when each
is on, what it requires and provides), and an explicit `passes` list is checked against them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tracked import tracked

from zerocc.compiler.driver.pass_manager import check_passes, pass_names
from zerocc.compiler.plan import load_plan

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "gpt"

# The default pass lists as plan.py's hand-written DEFAULT_PASSES / pass_names gave them before
# the order was derived from the specs (computed from that code, commit 37971a8).
OLD_EXAMPLE_PASSES = {
    "7b.yaml": ["partition", "shard", "precision", "optimizer", "overlap"],
    "zero0.yaml": ["partition", "shard", "optimizer", "overlap"],
    "zero1.yaml": ["partition", "shard", "optimizer", "overlap"],
    "zero2.yaml": ["partition", "shard", "optimizer", "overlap"],
    "zero3-bf16.yaml": ["partition", "shard", "precision", "optimizer", "overlap"],
    "zero3-offload.yaml": [
        "partition",
        "recompute",
        "shard",
        "precision",
        "optimizer",
        "overlap",
        "offload",
    ],
    "zero3.yaml": ["partition", "shard", "optimizer", "overlap"],
    "zero3-hsdp.yaml": ["partition", "shard", "optimizer", "overlap"],  # (added later)
    "zero3-tp.yaml": ["partition", "shard", "optimizer", "overlap"],  # (added later)
    "70b-tp.yaml": ["partition", "shard", "precision", "optimizer", "overlap"],  # (added later)
}
OLD_EXAMPLE_PASSES["7b-offload.yaml"] = OLD_EXAMPLE_PASSES["zero3-offload.yaml"]  # (later)
OLD_EXAMPLE_PASSES["zero3-pp.yaml"] = OLD_EXAMPLE_PASSES["zero3.yaml"]  # (later; each stage's)
OLD_EXAMPLE_PASSES["70b-pp.yaml"] = OLD_EXAMPLE_PASSES["70b-tp.yaml"]  # (later)
OLD_EXAMPLE_PASSES["405b-pp.yaml"] = OLD_EXAMPLE_PASSES["70b-tp.yaml"]  # (later)
# Examples a whole-step compile does not inspect: a pipeline's stage programs are compiled by
# its step's pipeline walk, which tests/cli/test_cli_pipeline.py trains, and by the pipeline
# estimate (tests/inspect/test_pipeline_estimate.py), with ZEROCC_VERIFY on in CI.
PIPELINE_EXAMPLES = {"zero3-pp.yaml", "70b-pp.yaml", "405b-pp.yaml"}


@pytest.mark.parametrize("name", sorted(OLD_EXAMPLE_PASSES))
def test_examples_keep_their_default_pipeline(name):
    assert pass_names(load_plan(EXAMPLES / name)) == OLD_EXAMPLE_PASSES[name]


def test_every_example_is_covered():
    """Every example plan git tracks (a plan `zerocc plan auto` wrote beside them is not one)."""
    assert sorted(p.name for p in tracked(EXAMPLES, "*.yaml")) == sorted(OLD_EXAMPLE_PASSES)


# (precision, recompute.units, offload.optimizer, overlap.enabled) -> old default pass list
OLD_PASS_LISTS = {
    ("fp32", "none", "none", True): ["partition", "shard", "optimizer", "overlap"],
    ("fp32", "none", "none", False): ["partition", "shard", "optimizer"],
    ("fp32", "none", "cpu", True): ["partition", "shard", "optimizer", "overlap", "offload"],
    ("fp32", "none", "cpu", False): ["partition", "shard", "optimizer", "offload"],
    ("fp32", "all", "none", True): ["partition", "recompute", "shard", "optimizer", "overlap"],
    ("fp32", "all", "none", False): ["partition", "recompute", "shard", "optimizer"],
    ("fp32", "all", "cpu", True): [
        "partition",
        "recompute",
        "shard",
        "optimizer",
        "overlap",
        "offload",
    ],
    ("fp32", "all", "cpu", False): ["partition", "recompute", "shard", "optimizer", "offload"],
    ("bf16", "none", "none", True): ["partition", "shard", "precision", "optimizer", "overlap"],
    ("bf16", "none", "none", False): ["partition", "shard", "precision", "optimizer"],
    ("bf16", "none", "cpu", True): [
        "partition",
        "shard",
        "precision",
        "optimizer",
        "overlap",
        "offload",
    ],
    ("bf16", "none", "cpu", False): ["partition", "shard", "precision", "optimizer", "offload"],
    ("bf16", "all", "none", True): [
        "partition",
        "recompute",
        "shard",
        "precision",
        "optimizer",
        "overlap",
    ],
    ("bf16", "all", "none", False): ["partition", "recompute", "shard", "precision", "optimizer"],
    ("bf16", "all", "cpu", True): [
        "partition",
        "recompute",
        "shard",
        "precision",
        "optimizer",
        "overlap",
        "offload",
    ],
    ("bf16", "all", "cpu", False): [
        "partition",
        "recompute",
        "shard",
        "precision",
        "optimizer",
        "offload",
    ],
}


@pytest.mark.parametrize(("precision", "recompute", "offload", "overlap"), sorted(OLD_PASS_LISTS))
def test_default_pipeline_is_the_old_one(precision, recompute, offload, overlap):
    plan = {
        "zero": {"stage": 3},
        "overlap": {"enabled": overlap},
        "recompute": {"units": recompute},
        "offload": {"optimizer": offload},
    }
    if precision != "fp32":
        plan["precision"] = {"param": precision}
    expected = OLD_PASS_LISTS[(precision, recompute, offload, overlap)]
    assert pass_names(load_plan(plan)) == expected
    check_passes(load_plan({**plan, "passes": expected}))  # the default, listed: allowed


def test_overlap_may_be_left_out_of_a_listed_pipeline():
    check_passes(load_plan({"passes": ["partition", "shard", "optimizer"]}))


# The world sizes the examples' layouts ask for (2 where any will do).
EXAMPLE_WORLDS = {
    "zero3-hsdp.yaml": 4,  # 2 replicas of 2-rank shard groups
    "zero3-tp.yaml": 4,  # 2 data-parallel × 2 tensor-parallel
    "70b-tp.yaml": 1024,  # dp 128 × tp 8
}


@pytest.mark.parametrize("name", sorted(set(OLD_EXAMPLE_PASSES) - PIPELINE_EXAMPLES))
def test_example_pipelines_provide_what_they_promise(name, monkeypatch):
    """Every capability each pass of each example promises, checked on the graph after it
    (ZEROCC_VERIFY), compiled on fake tensors."""
    from zerocc.inspect.estimate import inspect_plan

    monkeypatch.setenv("ZEROCC_VERIFY", "1")
    plan = load_plan(EXAMPLES / name)
    if name in ("70b-tp.yaml", "7b-offload.yaml"):  # its layout, two of its blocks (alike)
        plan.workload_args["n_layer"] = 2
    world = EXAMPLE_WORLDS.get(name, 2)
    inspect_plan(plan, world_size=world)
