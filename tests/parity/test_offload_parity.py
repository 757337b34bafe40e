"""Offload on 2 gloo ranks: every placement trains as unsharded training does, and exactly as
the same plan without offload.

Two checks per case. Against the one-process reference with the tolerances of the other parity
tests (fp32 1e-5, see test_parity.py; bf16 1e-2, see test_mixed_precision_parity.py). And
against the same plan without offload with no tolerance at all: offload moves states and
copies tensors, the update runs the same kernel on the same fp32 values wherever they live, and
the compute copy is cast from the same master, so losses and weights must be bit-identical.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from multirank import run_ranks
from optional_deps import triton_fma_problem

from parity import (
    assert_bit_identical,
    assert_matches_reference,
    case_id,
    train,
)

NVME = Path(tempfile.gettempdir()) / "zerocc-test-nvme"
NVME.mkdir(exist_ok=True)
CPU = {"optimizer": "cpu"}
ON_NVME = {"optimizer": "nvme", "nvme_path": str(NVME)}
CLIPPED = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "grad_clip": 0.05}
BF16 = {"param": "bf16"}

CASES = [
    {"model": "gpt", "stage": 3, "offload": CPU},
    {"model": "gpt", "stage": 3, "offload": ON_NVME},
    {"model": "gpt", "stage": 3, "offload": {**CPU, "ratio": 0.5}},
    {"model": "gpt", "stage": 3, "offload": {"params": "cpu"}},
    {"model": "gpt", "stage": 3, "offload": {"params": "nvme", "nvme_path": str(NVME)}},
    # fp32 with states and parameters together: no master, the update writes the parameters.
    {"model": "gpt", "stage": 3, "offload": {**CPU, "params": "cpu"}},
    {"model": "gpt", "stage": 3, "offload": {**ON_NVME, "params": "nvme"}},
    {"model": "gpt", "stage": 2, "offload": CPU},
    {"model": "gpt", "stage": 1, "offload": ON_NVME, "accum": 2, "optimizer": CLIPPED},
    {"model": "odd", "stage": 2, "offload": {**ON_NVME, "ratio": 0.5},
     "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
    {"model": "gpt", "stage": 3, "offload": {**CPU, "params": "cpu"}, "precision": BF16},
    {"model": "gpt", "stage": 2, "offload": ON_NVME, "precision": BF16},
    # Everything together: part of the model on NVMe, parameters on the host, recomputation.
    {"model": "gpt", "stage": 3, "accum": 2, "optimizer": CLIPPED,
     "offload": {**ON_NVME, "params": "cpu", "ratio": 0.5},
     "recompute": {"units": "all"}},
    {"model": "gpt", "stage": 3, "precision": BF16, "recompute": {"units": "all"},
     "offload": {**ON_NVME, "params": "nvme"}},
    # The one-pass update (the host's on a GPU machine), clipped, accumulated; SGD with a bf16
    # copy written in the same loop.
    {"model": "gpt", "stage": 3, "accum": 2, "optimizer": CLIPPED, "kernels": "one-pass",
     "offload": {**CPU, "ratio": 0.5}},
    {"model": "gpt", "stage": 2, "precision": BF16, "kernels": "one-pass",
     "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "offload": CPU},
    # A parameter the loss never reaches, its compute copy written from a shared host buffer.
    {"model": "unused", "stage": 3, "precision": BF16, "offload": CPU},
    # Gradients kept on the device until their updates, copied through two host buffers.
    {"model": "gpt", "stage": 3, "precision": BF16, "optimizer": CLIPPED,
     "offload": {**CPU, "grads": "device"}},
    {"model": "gpt", "stage": 2, "accum": 2,
     "offload": {**ON_NVME, "ratio": 0.5, "grads": "device"}},
    # Gradient copies to the host waited for one unit on, and not at all before the updates.
    {"model": "gpt", "stage": 3, "precision": BF16, "optimizer": CLIPPED,
     "offload": {**CPU, "grads_in_flight": 1}},
    {"model": "gpt", "stage": 2, "offload": {**CPU, "grads_in_flight": None}},
    # Host updates carried into the next step, waited for before each unit's first gather.
    {"model": "gpt", "stage": 3, "offload": {**CPU, "defer_updates": "next_forward"}},
    {"model": "unused", "stage": 3, "precision": BF16,
     "offload": {**CPU, "defer_updates": "next_forward"}},
    # fp32 states and parameters together: the carried update writes the weights themselves.
    {"model": "gpt", "stage": 3,
     "offload": {**CPU, "params": "cpu", "defer_updates": "next_forward"}},
    {"model": "gpt", "stage": 3, "precision": BF16, "optimizer": CLIPPED,
     "offload": {**CPU, "params": "cpu", "ratio": 0.5, "defer_updates": "next_forward"}},
    # Stages 1-2: each carried update's shard all-gathered into the whole weights at their
    # first read, the units left on the device all-gathered at the step's end.
    {"model": "gpt", "stage": 2, "offload": {**CPU, "defer_updates": "next_forward"}},
    {"model": "gpt", "stage": 1, "precision": BF16, "optimizer": CLIPPED,
     "offload": {**CPU, "ratio": 0.5, "defer_updates": "next_forward"}},
]  # fmt: skip
# The delayed parameter update: its own numerics, held to a delayed-update reference.
DELAYED = [
    {"model": "gpt", "stage": 3, "world": 2, "steps": 4, "optimizer": CLIPPED,
     "offload": {**CPU, "defer_updates": "delayed"}},
    # Two micro-batches a step: the step's gradient on the weights before the last update.
    {"model": "gpt", "stage": 3, "world": 2, "steps": 3, "accum": 2, "precision": {},
     "offload": {**CPU, "defer_updates": "delayed"}},
    # Stages 1-2 (ZeRO-Offload's own setting): the weights all-gathered after their last read.
    {"model": "gpt", "stage": 2, "world": 2, "steps": 4, "optimizer": CLIPPED,
     "offload": {**CPU, "defer_updates": "delayed"}},
    {"model": "gpt", "stage": 1, "world": 2, "steps": 3, "accum": 2, "precision": {},
     "offload": {**CPU, "defer_updates": "delayed"}},
    # Half the model offloaded: only its units' updates lag, the others' apply in their step.
    {"model": "gpt", "stage": 3, "world": 2, "steps": 4, "optimizer": CLIPPED,
     "offload": {**CPU, "ratio": 0.5, "defer_updates": "delayed"}},
    {"model": "gpt", "stage": 1, "world": 2, "steps": 3, "accum": 2, "precision": {},
     "offload": {**CPU, "ratio": 0.5, "defer_updates": "delayed"}},
]  # fmt: skip


# The host's update (one-pass, as on a GPU machine) against the GPU's (the Triton kernels,
# interpreted here): the same arithmetic, so the same training bit for bit (test_cuda.py holds
# the two to it on a GPU).
AS_ON_A_GPU = [
    {"model": "gpt", "stage": 3, "precision": BF16, "optimizer": CLIPPED, "offload": CPU},
    {"model": "gpt", "stage": 3, "precision": BF16, "recompute": {"units": "all"},
     "offload": {**CPU, "params": "cpu", "defer_updates": "next_forward"}},
]  # fmt: skip


def _host_and_gpu(case: dict) -> tuple[dict, dict]:
    host = {"world": 2, "steps": 3, "kernels": "one-pass", **case}
    return host, {**{k: v for k, v in host.items() if k != "offload"}, "kernels": "triton"}


def _pair(case: dict) -> tuple[dict, dict]:
    offloaded = {"world": 2, "steps": 3, **case}
    return offloaded, {k: v for k, v in offloaded.items() if k != "offload"}


@functools.cache
def _results() -> list[dict]:
    as_on_a_gpu = [] if triton_fma_problem() else AS_ON_A_GPU
    pairs = [c for case in CASES for c in _pair(case)]
    pairs += [c for case in as_on_a_gpu for c in _host_and_gpu(case)]
    return run_ranks(2, train, pairs + DELAYED)


@pytest.mark.parametrize("case", CASES, ids=lambda c: case_id({"world": 2, **c}))
def test_offload_matches_unsharded_training_and_the_plan_without_it(case):
    offloaded, resident = _pair(case)
    assert_bit_identical(_results(), offloaded, resident)
    assert_matches_reference(_results(), offloaded, 1e-2 if "precision" in case else 1e-5)


@pytest.mark.parametrize("case", AS_ON_A_GPU, ids=lambda c: case_id({"world": 2, **c}))
def test_an_update_on_the_host_trains_as_the_gpus_kernel_does(case):
    """Before 2026-11-26 the one-pass loop rounded lerp and addcmul twice where the Triton
    kernel uses one fma: the weights differed after a few steps."""
    problem = triton_fma_problem()
    if problem:
        pytest.skip(problem)
    assert_bit_identical(_results(), *_host_and_gpu(case))


@pytest.mark.parametrize("case", DELAYED, ids=case_id)
def test_delayed_updates_match_a_delayed_update_reference(case):
    """fp32 at the other parity tests' tolerance (1e-5): the delayed reference applies step
    s-1's update while step s computes on the weights before it (tests/parity)."""
    assert_matches_reference(_results(), case, 1e-5)


def test_state_files_are_removed_at_exit():
    _results()
    assert not any(NVME.iterdir()), list(NVME.iterdir())
