"""A world of one rank communicates nothing: no gather, reduce, pack or collective of any kind in
any program of any stage, parameters read where they are kept, 0 bytes said by explain and
estimate. One process, no process group (zerocc's SoloComm)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import build
from parity import batch_of

import zerocc
from zerocc.engine.comm import SoloComm
from zerocc.inspect.estimate import estimate, inspect_plan
from zerocc.inspect.explain import describe
from zerocc.ir.nodes import GATHERED, GRAD_SHARD, PARAM_SHARD, info, op_name, placeholders, val
from zerocc.ir.ops import COLLECTIVE_STARTS

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "gpt"
# What a rank does only to talk to others: collectives, their waits, packing gradients into a
# buffer for a reduction, freeing a gathered copy.
COMMUNICATION = {f"zerocc.{n}" for n in (*COLLECTIVE_STARTS, "wait", "pack", "free")}
FP16 = {"param": "fp16", "dynamic": {"hysteresis": 1}}


def trained(
    stage: int,
    accum: int = 1,
    precision: dict | None = None,
    optimizer: dict | None = None,
    **plan,
):
    plan = {
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "grad_accumulation": accum,
        # The norm would be all-reduced where ranks hold slices.
        "optimizer": {"grad_clip": 1.0, **(optimizer or {})},
        "precision": precision or {},
        **plan,
    }
    step = zerocc.compile(build("gpt"), plan)
    calls = []
    for i in range(2 * accum):
        step(*batch_of({"model": "gpt"}, i, 0))
        calls.append(dict(step.comm.stats.calls))
    return step, calls


def communication(step) -> list[str]:
    return [
        f"{op_name(n.target)} ({program})"
        for (_, boundary), program_ in step.programs.items()
        for program in ["step" if boundary else "accumulate"]
        for n in program_.gm.graph.nodes
        if op_name(n.target) in COMMUNICATION
    ]


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize(
    "precision", [{}, {"param": "bf16", "reduce": "bf16"}, FP16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_program_of_one_rank_communicates(stage, precision, accum):
    step, calls = trained(stage, accum, precision)
    assert isinstance(step.comm, SoloComm)
    assert not communication(step)
    assert calls == [{}] * len(calls)  # nothing reached the comm either
    assert describe(step.record())["comm_bytes_per_step"] == {}
    assert "none                      0B  (one rank: nothing to gather or reduce)" in step.explain()
    # Gradients persist only to be accumulated.
    assert bool([k for k in step.state if k.endswith(".grad")]) == (accum > 1)


@pytest.mark.parametrize("offload", [{"optimizer": "cpu"}, {"optimizer": "cpu", "params": "cpu"}])
def test_offload_on_one_rank_copies_but_does_not_communicate(offload):
    """Offload's copies are what it is for; nothing else moves. A unit whose optimizer states are
    on the host packs its gradient once, for its one copy there; parameter shards kept on the
    host are copied in once per phase (one rank gathers nothing)."""
    step, _ = trained(3, precision={"param": "bf16"}, offload=offload)
    names = [op_name(n.target) for n in step.program.graph.nodes]
    assert not {n for n in names if n in COMMUNICATION} - {"zerocc.pack", "zerocc.wait"}
    assert names.count("zerocc.pack") == len(step.units)
    assert all(
        info(n.args[0]).stream == "copy" for n in step.program.graph.nodes if n.target is wait_op()
    )
    params_in = [
        n for n in step.program.graph.nodes if "parameter shard in" in (info(n).note or "")
    ]
    expected = 2 * len(step.units) if "params" in offload else 0  # forward and backward
    assert len(params_in) == expected


def wait_op():
    return torch.ops.zerocc.wait.default


@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_offload_on_one_rank_trains_as_without_it(grad_clip):
    """Bit-identical without clipping. With it, 1e-6 relative: the gradient norm sums squares
    per parameter without offload (gradients are views of backward's) and per packed flat with
    it (gradients packed to be copied out), the same numbers summed in another order, which
    moves the norm by an ulp or so (~1e-9 absolute on the weights, measured on an AVX2 CPU;
    equal on the machine that first ran this test)."""
    plan = {"precision": {"param": "bf16"}, "optimizer": {"grad_clip": grad_clip}}
    plain, _ = trained(3, **plan)
    offloaded, _ = trained(3, **plan, offload={"optimizer": "cpu", "params": "cpu"})
    for name, value in plain.full_state_dict().items():
        theirs = offloaded.full_state_dict()[name]
        if grad_clip is None:
            assert torch.equal(value, theirs), name
        else:
            torch.testing.assert_close(theirs, value, rtol=1e-6, atol=1e-8, msg=name)


def test_one_rank_reads_parameters_where_they_are_kept():
    """Stage 3's shard is the whole flat on one rank: forward and backward read views of it,
    bf16 as stored (no gather, no copy, no per-use cast)."""
    step, _ = trained(3, precision={"param": "bf16"})
    (graph,) = [step.program.graph]
    assert not [n for n in graph.nodes if info(n).role == GATHERED]
    for shard in placeholders(step.program, PARAM_SHARD):
        assert val(shard).dtype == torch.bfloat16
        compute = [u for u in shard.users if info(u).phase in ("forward", "backward")]
        assert compute and all(op_name(u.target) == "aten.slice" for u in compute)
    casts = [
        n
        for n in graph.nodes
        if op_name(n.target) == "aten._to_copy" and val(n.args[0]).dtype == torch.bfloat16
    ]
    assert not [n for n in casts if info(n).phase != "forward"], casts


def test_one_rank_updates_each_parameter_from_backwards_gradient():
    """Without accumulation nothing is packed: each parameter's slice of the flat weights and
    moments is updated from its own gradient, a view of what backward produced (bf16 as it is:
    the update computes in fp32 anyway)."""
    step, _ = trained(2, precision={"param": "bf16"})
    updates = [n for n in step.program.graph.nodes if op_name(n.target) == "zerocc.adamw_"]
    trainable = sum(len(u.params) for u in step.units if u.trainable)
    assert len(updates) == trainable
    for update in updates:
        grad = update.args[1]
        assert info(grad).role == GRAD_SHARD and op_name(grad.target) == "aten.view"
        assert val(grad).dtype == torch.bfloat16
        assert info(grad.args[0]).phase == "backward" and not info(grad.args[0]).unit
        offset, numel = info(grad).span
        weights = update.args[0]
        assert op_name(weights.target) == "aten.slice"
        assert weights.args[2:] == (offset, offset + numel)


def test_a_parameter_the_loss_does_not_reach_is_not_updated_on_one_rank():
    plan = {"zero": {"stage": 3}, **_unused_units()}
    step = zerocc.compile(build("unused"), plan)
    before = step.full_state_dict()
    for i in range(2):
        step(*batch_of({"model": "unused"}, i, 0))
    after = step.full_state_dict()
    unused = [k for k in before if "pooler" in k]
    assert unused and all(torch.equal(before[k], after[k]) for k in unused)
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in unused)


def _unused_units() -> dict:
    from models import MODELS

    return {"units": MODELS["unused"][2]}


def test_estimate_of_one_rank_says_0_bytes():
    inspection = inspect_plan(EXAMPLES / "zero3.yaml", 1)
    figures = estimate(inspection)
    assert figures.comm == {} and figures.timing.comm_s == 0
    assert figures.peak["gathered"] == 0 and figures.model_states["grads"] == 0
    run = subprocess.run(
        [sys.executable, "-m", "zerocc", "estimate", str(EXAMPLES / "zero3.yaml"),
         "--world-size", "1", "--table"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("communication"))
    assert row.split()[-4:] == ["0B"] * 4, row
