"""Offload in one process: where the states live, what they cost in memory, and bad input.

Bad input fails before training starts (a plan error, or an ``OffloadError`` from
``zerocc.compile``); a disk that fills up during training stops it with a clear error and
leaves the last checkpoint loadable.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from models import build
from optional_deps import needs_triton
from parity import batch_of

import zerocc
from zerocc.compiler.driver.pass_manager import check_passes
from zerocc.compiler.passes.offload import UPDATE_ARGS
from zerocc.compiler.state import offloaded_units
from zerocc.errors import OffloadError, PlanError
from zerocc.inspect.explain import describe
from zerocc.ir.nodes import info, op_name
from zerocc.ir.ops import HOST_TO_HOST
from zerocc.runtime import nvme

GPT = {"model": "gpt"}


def _plan(nvme_path: Path | str | None = None, **offload) -> dict:
    if nvme_path is not None:
        offload["nvme_path"] = str(nvme_path)
    return {
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "optimizer": {"lr": 1e-2, "eps": 1e-3},
        "precision": {"param": "bf16"},
        "offload": offload,
    }


def _trained(plan: dict, steps: int = 1) -> zerocc.TrainStep:
    step = zerocc.compile(build("gpt"), plan)
    for i in range(steps):
        step(*batch_of(GPT, i, 0))
    return step


# -- where the states live --------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_optimizer_offload_moves_the_offloaded_share_of_12_psi_off_the_device(ratio, tmp_path):
    """bf16 compute, fp32 masters: the device keeps 2 + 4 bytes per shard element of an
    offloaded unit instead of 2 + 4 + 12; the 12 (master, exp_avg, exp_avg_sq) are measured in
    the host pool (cpu) or in the state files (nvme)."""
    resident = _trained(_plan()).state.bytes_by_location()
    for where, pool in (("cpu", "host"), ("nvme", "nvme")):
        step = _trained(_plan(tmp_path if where == "nvme" else None, optimizer=where, ratio=ratio))
        share = 12 * sum(u.shard_numel for u in offloaded_units(step.units, ratio))
        assert 0 < share <= 12 * sum(u.shard_numel for u in step.units)
        measured = step.state.bytes_by_location()
        assert resident["device"]["total"] - measured["device"]["total"] == share
        assert measured["device"]["grads"] == resident["device"]["grads"]
        offloaded = measured[pool]["optimizer"]
        # State files carry a small header each (dtype, shape, key, generation).
        assert share <= offloaded <= share + 3 * len(step.units) * 512, (where, offloaded)


def test_parameter_offload_moves_the_shards_off_the_device():
    step = _trained(_plan(params="cpu"))
    measured = step.state.bytes_by_location()
    assert measured["device"]["params"] == 0
    assert measured["host"]["params"] == 2 * sum(u.shard_numel for u in step.units)


def test_fp32_states_with_their_parameters_keep_no_second_copy():
    """fp32, optimizer and parameters both on the host: the update writes the parameter shard
    in place, so the host holds 4 + 4 + 4 bytes per element (param, exp_avg, exp_avg_sq)."""
    plan = {**_plan(optimizer="cpu", params="cpu"), "precision": {}}
    step = _trained(plan)
    measured = step.state.bytes_by_location()
    shards = sum(u.shard_numel for u in step.units)
    assert measured["host"]["total"] == 12 * shards
    assert measured["device"]["params"] == 0
    assert measured["device"]["grads"] == 0  # grad_accumulation 1: no gradient is state
    assert not [k for k in step.state if k.endswith(".master")]


def test_explain_shows_where_bytes_live_and_the_traffic(tmp_path):
    step = _trained(_plan(tmp_path, optimizer="nvme", params="cpu"))
    text = step.explain()
    assert "where the model states live" in text and "nvme" in text
    assert "(offload.grads: cpu, at most 2 on their way at once): host memory of every" in text
    assert "an offloaded unit's leave the device as they are copied to the host" in text
    traffic = describe(step.record())["transfer_bytes_per_step"]
    shards = sum(u.shard_numel for u in step.units)
    # Per step: fp32 gradient shards out and the 4-byte non-finite flag the host updates read
    # (the update writes the bf16 compute copy in host memory itself: no copy); each parameter
    # shard in for its forward and its backward (one rank gathers nothing); three fp32 states
    # read and written.
    assert traffic["to_host"] == 4 * shards + 4
    assert traffic["to_device"] == 2 * 2 * shards
    assert traffic["nvme_read"] == traffic["nvme_write"] == 3 * 4 * shards


def test_loss_scaled_gradients_are_not_said_to_leave_the_device():
    """fp16 with loss scaling unscales every gradient in place after backward, so an
    offloaded one is copied to the host after that: explain() does not say it leaves the
    device during backward."""
    plan = {**_plan(optimizer="cpu"), "precision": {"param": "fp16"}}
    assert "leave the device" not in _trained(plan).explain()


def test_offloaded_program_says_why_each_copy_is_there():
    step = _trained(_plan(optimizer="cpu", params="cpu"))
    notes = [n.meta["zerocc"].note or "" for n in step.program.graph.nodes]
    assert any("reduced gradient to the host once it is complete" in n for n in notes)
    # One rank gathers nothing: the shard is copied in once for each phase's reads.
    assert any("parameter shard in for its reads in backward" in n for n in notes)
    assert not any("into its compute copy" in n for n in notes)  # the update writes it


def _is_param_shard(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and (info(node).key or "").endswith(".param")


def test_host_updates_write_compute_copies_in_host_memory_themselves():
    """bf16 parameters on the host: each host update casts its master into the parameter
    shard in its own pass (its ``param_copy``), with no second pass over the master; with
    ``offload.defer_updates: delayed``, whose step still reads the old shard while the update runs,
    the update writes its master and the copy into the shard follows the step's last read."""
    for pipeline, in_place in (("none", True), ("next_forward", True), ("delayed", False)):
        plan = _plan(optimizer="cpu", params="cpu")
        plan["offload"]["defer_updates"] = pipeline
        program = _trained(plan).program
        updates = [n for n in program.graph.nodes if op_name(n.target) == "zerocc.adamw_"]
        copies = [n for n in program.graph.nodes if op_name(n.target) == "zerocc.copy_into_start"
                  and _is_param_shard(n.args[0])]  # fmt: skip
        assert updates, pipeline
        for update in updates:
            copy = update.args[UPDATE_ARGS["zerocc.adamw_"]["copy"]]
            assert _is_param_shard(copy) == in_place, pipeline
        assert len(copies) == (0 if in_place else len(updates)), pipeline
        # A copy between two host tensors: host work, as the cost model times it.
        assert all(c.args[-1] == HOST_TO_HOST and info(c).pool == "host" for c in copies)


# -- bad input, before training starts --------------------------------------------------


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"zero": {"stage": 0}, "offload": {"optimizer": "cpu"}}, "needs a sharded optimizer"),
        ({"zero": {"stage": 2}, "offload": {"params": "cpu"}}, "needs zero.stage: 3"),
        ({"offload": {"optimizer": "nvme"}}, "needs offload.nvme_path"),
        ({"offload": {"ratio": 0}}, "ratio"),
        ({"offload": {"grads": "device"}}, "offload.optimizer is none"),
        ({"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "grads": "device",
                                            "defer_updates": "next_forward"}},
         "offload.grads: device needs offload.defer_updates: none"),
        ({"offload": {"grads": "gpu"}}, "allowed values: 'cpu', 'device'"),
        ({"offload": {"optimizer": "cpu"}, "passes": ["partition", "shard", "optimizer"]},
         "does not list 'offload'"),
    ],
)  # fmt: skip
def test_bad_offload_plans_are_plan_errors(plan, message):
    with pytest.raises(PlanError, match=message):
        check_passes(zerocc.load_plan(plan))


def test_missing_nvme_path_fails_at_compile(tmp_path):
    with pytest.raises(OffloadError, match="does not exist"):
        zerocc.compile(build("gpt"), _plan(tmp_path / "absent", optimizer="nvme"))


def test_nvme_path_that_is_a_file_fails_at_compile(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OffloadError, match="not a directory"):
        zerocc.compile(build("gpt"), _plan(tmp_path / "file", optimizer="nvme"))


def test_unwritable_nvme_path_fails_at_compile():
    # /proc takes no new files, even for root (chmod does not stop root).
    with pytest.raises(OffloadError, match="/proc"):
        zerocc.compile(build("gpt"), _plan("/proc", optimizer="nvme"))


def test_too_little_disk_fails_at_compile_naming_the_bytes(tmp_path, monkeypatch):
    real = nvme.shutil.disk_usage

    def nearly_full(path):
        return real(path)._replace(free=1000)

    monkeypatch.setattr(nvme.shutil, "disk_usage", nearly_full)
    with pytest.raises(OffloadError, match="not enough disk") as caught:
        zerocc.compile(build("gpt"), _plan(tmp_path, optimizer="nvme"))
    assert "1000 bytes" in str(caught.value) or "free" in str(caught.value)
    assert not list(tmp_path.glob("*/rank0/*.zcc")), "states were written before the check"


# -- a disk that fills up during training -----------------------------------------------


def test_disk_full_during_training_stops_clearly_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    plan = _plan(tmp_path / "nvme", optimizer="nvme", params="nvme")
    (tmp_path / "nvme").mkdir()
    step = _trained(plan, steps=2)
    checkpoint = tmp_path / "ckpt.pt"
    torch.save(step.state_dict(), checkpoint)
    saved = torch.load(checkpoint)

    def disk_full(f, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(nvme, "_write_chunk", disk_full)
    with pytest.raises(OffloadError, match="disk full") as caught:
        step(*batch_of(GPT, 2, 0))
    assert "step 3" in str(caught.value) and "load the last checkpoint" in str(caught.value)
    monkeypatch.undo()

    # The checkpoint is intact, and a fresh run restored from it trains on exactly as the
    # uninterrupted run does.
    reloaded = torch.load(checkpoint)
    assert reloaded.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(reloaded[key], value), key
    restored = zerocc.compile(build("gpt"), plan)
    restored.load_state_dict(reloaded)
    uninterrupted = _trained(plan, steps=2)
    for i in (2, 3):
        assert float(restored(*batch_of(GPT, i, 0))) == float(uninterrupted(*batch_of(GPT, i, 0)))


# -- peak resident memory ---------------------------------------------------------------

_PEAK_RSS = textwrap.dedent(
    """
    import json, resource, sys, torch
    sys.path.insert(0, {gpt!r})
    import zerocc
    from model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=4096, block_size=32, n_layer=8, n_head=8, n_embd=512)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = {{"zero": {{"stage": 3}}, "units": {{"classes": ["Block"]}}, "offload": {offload}}}
    step = zerocc.compile(model, plan)
    idx = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        step(idx, idx)
    # This process's own peak (VmHWM): ru_maxrss also counts the parent it was spawned from,
    # whose resident set (a test process grown large) it keeps across exec.
    with open("/proc/self/status") as status:
        hwm = [int(line.split()[1]) for line in status if line.startswith("VmHWM:")]
    peak = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({{"peak": peak * 1024}}))
    """
)


def _peak_rss(offload: dict) -> int:
    gpt = str(Path(__file__).parents[2] / "examples" / "gpt")
    code = _PEAK_RSS.format(gpt=gpt, offload=json.dumps(offload))
    # A fixed mmap threshold: glibc then returns every freed buffer of 1 MiB or more to the
    # system at once, so the peak RSS shows what the program holds, not what the allocator
    # keeps cached after its default threshold has grown to the size of the freed buffers.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
        env=env,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def test_nvme_offload_lowers_the_peak_resident_memory(tmp_path):
    """27M parameters, fp32, one rank: host offload keeps the master weights and both Adam
    moments in memory (12 bytes per parameter, 324 MB); NVMe keeps them in files, with at most
    three units' states (38 MB each) in host buffers at once (one being read, one updating, one
    being written): 324 - 113 = 211 MB less at the peak (measured: 219 MB)."""
    in_memory = _peak_rss({"optimizer": "cpu"})
    on_disk = _peak_rss({"optimizer": "nvme", "nvme_path": str(tmp_path)})
    assert in_memory - on_disk >= 180 * 2**20, (in_memory / 2**20, on_disk / 2**20)


# -- zerocc estimate ----------------------------------------------------------------------


def test_estimate_predicts_the_pools_and_traffic_a_run_measures(tmp_path):
    from workload import workload

    from zerocc.inspect.estimate import estimate, inspect_plan

    small = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4}
    plan = {
        **_plan(tmp_path, optimizer="nvme", params="cpu", ratio=0.5),
        "workload": "workload:workload",
        "workload_args": small,
    }
    work = workload(**small)
    step = zerocc.compile(work.model, plan)
    step(*next(work.batches(0, 1)))
    predicted = estimate(inspect_plan(plan, 1, workload(**small)))
    measured = step.state.bytes_by_location()
    assert predicted.model_states["total"] == measured["device"]["total"]
    assert predicted.offloaded["host"] == measured["host"]["total"] > 0
    # Files hold a header (< 512 bytes) besides each state.
    nvme_states = predicted.offloaded["nvme"]
    headers = 512 * len(step.state.nvme_specs)
    assert nvme_states <= measured["nvme"]["total"] <= nvme_states + headers
    # An in-memory snapshot holds every state, wherever it is (checkpoint.in_memory's row).
    snapshot = sum(t.nbytes for t in step.state_dict().values() if isinstance(t, torch.Tensor))
    assert predicted.snapshot_bytes == snapshot
    assert predicted.transfers == describe(step.record())["transfer_bytes_per_step"]
    # Host buffers at their peak: the offloaded units' fp32 gradient shards (copied out as they
    # complete, kept until their updates) and at most three units' states read from NVMe.
    offloaded = offloaded_units(step.units, 0.5)
    largest = max(u.shard_numel for u in offloaded)
    grads = 4 * sum(u.shard_numel for u in offloaded)
    assert grads <= predicted.peak["host_buffers"] <= grads + 3 * 12 * largest + 8
    assert predicted.transfers == dict(step.transfers.stats.bytes)  # what the copies moved


def test_gradients_copied_to_the_host_leave_the_device_as_they_go():
    """``offload.grads: cpu``: each gradient is checked for inf/NaN (and its squared norm
    taken) once complete, and its copy to the host waited for before the gradient two on is
    complete, so the device holds at most three while they travel. Before, the step's check
    read every gradient at the end of backward: the device held all of them, as it does with
    ``grads: device``. Eight blocks, each recomputed (their gradients are most of what
    backward holds), one rank, as the estimate predicts it."""
    from workload import workload

    from zerocc.inspect.estimate import estimate, inspect_plan

    small = {"n_layer": 8, "n_head": 2, "n_embd": 64, "block_size": 16, "batch_size": 2}
    peaks, held, blocks, psi = {}, {}, [], 0
    for grads in ("cpu", "device"):
        plan = {**_plan(optimizer="cpu", grads=grads), "recompute": {"units": "all"}}
        inspection = inspect_plan(plan, 1, workload(**small))
        figures = estimate(inspection)
        peaks[grads], held[grads] = figures.peak["activations"], figures.held_grads
        blocks = [u for u in inspection.units if u.name != "root"]
        psi = sum(u.padded_numel for u in inspection.units)
    gradient = 4 * blocks[0].padded_numel  # one block's, fp32
    assert peaks["device"] - peaks["cpu"] >= (len(blocks) - 3) * gradient, (peaks, gradient)
    # The row of gradients held on the device within the step says so too.
    assert held == {"cpu": 0, "device": 4 * psi}


def test_more_gradients_in_flight_hold_more_device_memory_and_wait_less():
    """``offload.grads_in_flight`` trades device memory for backward's waits on the copies:
    with the host link slow beside backward, each bound holds at most that many gradients plus
    one (the peak within a block's gradient of the bound's), waits no longer than a tighter
    bound, and ``null`` never holds backward for them (as ``zerocc estimate`` shows)."""
    from workload import workload

    from zerocc.cli.inspect_report import _estimate_text
    from zerocc.cost.rates import DeviceRates
    from zerocc.inspect.estimate import estimate, inspect_plan
    from zerocc.ir.ops import TO_HOST

    small = {"n_layer": 8, "n_head": 2, "n_embd": 64, "block_size": 16, "batch_size": 2}
    rates = replace(DeviceRates.defaults("cuda"), host_link_bytes_per_s=1e8)  # copies: slow
    peaks, waits, hinted, block = {}, {}, {}, 0
    for bound in (1, 2, 5, None):
        plan = {**_plan(optimizer="cpu"), "recompute": {"units": "all"}}
        plan["offload"]["grads_in_flight"] = bound
        inspection = inspect_plan(plan, 1, workload(**small))
        figures = estimate(inspection, rates)
        peaks[bound], waits[bound] = figures.peak["activations"], figures.timing.copy_waited
        hinted[bound] = "offload.grads_in_flight: " in _estimate_text(inspection.plan, figures)
        block = 4 * max(u.padded_numel for u in inspection.units if u.name != "root")
    assert hinted == {1: True, 2: True, 5: True, None: False}
    assert peaks[1] < peaks[2] < peaks[5] < peaks[None], peaks
    assert peaks[5] - peaks[2] >= 3 * block - block // 2, (peaks, block)  # ~three blocks' more
    backward = {b: w.get((TO_HOST, "backward"), 0.0) for b, w in waits.items()}
    assert backward[1] >= backward[2] >= backward[5] > backward[None] == 0, backward


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"offload": {"grads_in_flight": 4}}, "offload.grads_in_flight bounds the copies"),
        ({"offload": {"optimizer": "cpu", "grads": "device", "grads_in_flight": None}},
         "offload.grads_in_flight bounds the copies"),
        ({"offload": {"optimizer": "cpu", "grads_in_flight": 0}}, "an integer >= 1"),
    ],
)  # fmt: skip
def test_a_bound_on_gradients_in_flight_without_their_copies_is_a_plan_error(plan, message):
    with pytest.raises(PlanError, match=message):
        zerocc.load_plan(plan)


def test_a_plan_dumped_with_the_default_bound_loads_with_gradients_on_the_device():
    """The memory check's suggestions dump a plan (every field set) and change it."""
    plan = zerocc.load_plan({"offload": {"optimizer": "cpu", "grads": "device"}})
    assert zerocc.load_plan(plan.model_dump()).offload.grads_in_flight == 2


@pytest.mark.parametrize(
    "pipeline, grads",
    [("none", "cpu"), ("next_forward", "cpu"), ("delayed", "cpu"), ("none", "device")],
)
def test_the_host_buffers_of_copies_are_made_once_and_hold_what_the_estimate_says(pipeline, grads):
    """The reduced gradients' host buffers (grads: device: two, each a unit's, used in turn;
    and the step's scalars', and the two buffers the host updates write compute copies into;
    delayed: one per unit) are made at the first step and reused by every later one; together
    they are the host buffers' peak that the estimate (and so the memory check) counts."""
    from workload import workload

    from zerocc.inspect.estimate import estimate, inspect_plan

    small = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4}
    ratio = 1.0 if grads == "device" else 0.5  # device: more units than gradient buffers
    plan = {**_plan(optimizer="cpu", ratio=ratio, defer_updates=pipeline, grads=grads),
            "workload": "workload:workload", "workload_args": small}  # fmt: skip
    work = workload(**small)
    step = zerocc.compile(work.model, plan)
    batches = work.batches(0, 1)
    step(*next(batches))
    first = {key: t.data_ptr() for key, t in step.transfers.host_buffers.buffers.items()}
    step(*next(batches))
    again = {key: t.data_ptr() for key, t in step.transfers.host_buffers.buffers.items()}
    assert again == first and len(first) > 1
    offloaded = offloaded_units(step.units, ratio)
    largest = max(u.shard_numel for u in offloaded)
    gradients = 4 * sum(u.shard_numel for u in offloaded)  # fp32
    if grads == "device":
        gradients = 2 * 4 * largest
    staging = 2 * 2 * largest  # two bf16 compute-copy buffers
    if pipeline == "delayed":
        staging = 2 * sum(u.shard_numel for u in offloaded)  # one per unit
    held = step.transfers.host_buffers.nbytes
    assert gradients + staging <= held <= gradients + staging + 64  # and the step's scalars
    assert estimate(inspect_plan(plan, 1, workload(**small))).peak["host_buffers"] == held


@pytest.mark.parametrize(
    "kernels", ["torch", "one-pass", pytest.param("triton", marks=needs_triton)]
)
def test_a_skipped_step_keeps_the_compute_copies_of_offloaded_units(kernels):
    """bf16 parameters on the device, the update on the host writing their copies into two
    host buffers used in turn: a step skipped for a non-finite loss writes no weight, yet
    every unit's compute copy must still come out of the buffer as its own weights (a buffer
    left as the unit before last wrote it gave units each other's weights). Bit-identical to
    the same plan without offload, two ranks simulated."""
    from models import _gpt_batch, tiny_gpt

    def trained(offload: dict) -> dict:
        torch.manual_seed(0)
        plan = {
            "zero": {"stage": 3},
            "units": {"classes": ["Block"]},
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "precision": {"param": "bf16", "on_nonfinite": "skip"},
            "backend": {"device": "cpu", "kernels": kernels},
            "offload": offload,
        }
        step = zerocc.compile(tiny_gpt(), plan, comm=zerocc.FakeComm(world_size=2),
                              loss_fn=lambda m, x, y, scale: m(x, y) * scale)  # fmt: skip
        for i, scale in enumerate([1.0, 1.0, float("inf"), 1.0, 1.0]):
            step(*_gpt_batch(i, 0), torch.tensor(scale))
        assert step.summary()["skipped_steps"] == 1
        return step.full_state_dict()

    resident, offloaded = trained({}), trained({"optimizer": "cpu"})
    for name, value in resident.items():
        assert torch.equal(offloaded[name], value), name


class _Gated(torch.nn.Module):
    """Four units; the loss reaches ``body.b`` only in batches of more than two rows."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.post, self.head = (torch.nn.Linear(8, n) for n in (8, 8, 1))
        # b first: in this rank's shard of the unit's flat (FakeComm runs rank 0)
        self.body = torch.nn.ModuleDict({"b": torch.nn.Linear(8, 8), "a": torch.nn.Linear(8, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body["a"](torch.relu(self.pre(x))))
        if x.shape[0] > 2:
            h = torch.relu(self.body["b"](h))
        return self.head(torch.relu(self.post(h))).pow(2).mean()


def test_a_parameter_the_loss_skipped_keeps_its_compute_copy():
    """Batches of two rows do not reach ``body.b``: its weights are not updated, and its
    compute copy must come out of the shared host buffer as those weights, not as what the
    unit before last left there; batches of four then read it. Bit-identical to the plan
    without offload (the buffer's old values restored gave 3e-2)."""

    def trained(offload: dict) -> dict:
        torch.manual_seed(0)
        plan = {
            "zero": {"stage": 3},
            "units": {"modules": ["pre", "body", "post", "head"]},
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "precision": {"param": "bf16"},
            "backend": {"device": "cpu", "kernels": "torch"},
            "offload": offload,
        }
        step = zerocc.compile(_Gated(), plan, comm=zerocc.FakeComm(world_size=2),
                              loss_fn=lambda m, x: m(x))  # fmt: skip
        g = torch.Generator().manual_seed(0)
        for rows in (2, 2, 2, 4, 4):
            step(torch.randn(rows, 8, generator=g))
        return step.full_state_dict()

    resident, offloaded = trained({}), trained({"optimizer": "cpu"})
    for name, value in resident.items():
        assert torch.equal(offloaded[name], value), name


def test_host_updates_get_this_ranks_share_of_the_cores(monkeypatch):
    """Each rank of a machine its own slice of the cores, pinned when the process may run on
    all of them; a set a launcher restricted is kept, and shared in threads."""
    from zerocc.engine.host_worker import host_update_cores

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    slices = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        cores, pin = host_update_cores()
        assert pin and len(cores) == 4
        slices.append(cores)
    assert sorted(c for cores in slices for c in cores) == list(range(16))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5, 7}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert host_update_cores() == ([5, 7], False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert len(host_update_cores()[0]) == 1


@needs_triton
def test_a_cpu_step_on_a_gpu_machine_keeps_its_kernels_and_pins_nothing(monkeypatch):
    """Only a step that computes on a GPU moves host updates to the one-pass CPU kernels and
    pins host buffers; a CPU rank on a machine with a GPU does neither (pinning would give it a
    CUDA context, and its `kernels: triton` would silently run the fused ones)."""
    from zerocc.backends.eager.ops import EagerOps
    from zerocc.backends.kernels import host_kernels, kernel_set
    from zerocc.engine import RuntimeContext
    from zerocc.engine.comm import SoloComm
    from zerocc.engine.transfers import Transfers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    host = torch.zeros(4)

    def ops_on(device: torch.device) -> EagerOps:
        engine = Transfers(device=device)
        return EagerOps(RuntimeContext(SoloComm(), engine, kernel_set("triton"), device))

    assert ops_on(torch.device("cpu")).kernels_for(host) is kernel_set("triton")
    assert ops_on(torch.device("cuda", 0)).kernels_for(host) is kernel_set(host_kernels())
    cpu_engine = ops_on(torch.device("cpu")).ctx.transfers
    assert not cpu_engine.empty(torch.device("cpu"), (4,), torch.float32, host).is_pinned()
