"""The Inductor backend on gloo ranks: each stage trains as one process training on all
ranks' batches does, and as the eager backend does, compiled by region (``inductor``: each
distinct compute region between zerocc's ops compiled once, none left to run eagerly).

Tolerances are the harness's for a compiling backend (``parity.COMPILED_FP32``,
``COMPILED_LOW``, justified there): fp32 1e-5 relative against both the reference and the eager
backend; bf16 compute 1e-2 on the losses and each weight matrix against the reference computing
in bf16 too, vector parameters held to it together, as one vector. The bf16 cases here train
with SGD; `pytest tests/parity --backend inductor` holds the AdamW ones of the other parity
tests to the same tolerances.
"""

from __future__ import annotations

import functools
import re

import pytest
from multirank import run_ranks

from parity import assert_matches_reference, assert_trained_alike, case_id, train

FP32 = [
    {"model": "gpt", "stage": 1},
    {"model": "gpt", "stage": 2, "accum": 2},
    {"model": "gpt", "stage": 3},
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu"}},  # the update on the host
    # Its gradients kept on the device, copied through the program's two host buffers.
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu", "grads": "device"}},
    # Host updates carried into the next step, issued to the host's worker from the graph.
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu", "defer_updates": "next_forward"}},
    {"model": "gpt", "stage": 3, "offload": {"optimizer": "cpu", "defer_updates": "delayed"}},
    # Stage 2: the carried copy writes this rank's view of the whole weights, all-gathered in
    # the graph before forward reads them.
    {"model": "gpt", "stage": 2, "offload": {"optimizer": "cpu", "defer_updates": "next_forward"}},
    # Dropout, recomputed, in the whole graph: the masks of ATen's generator, replayed for the
    # recomputation. Held to the eager backend only: the one-process reference draws its masks
    # in another order.
    {"model": "gpt_dropout", "stage": 3, "recompute": {"units": "all"}},
    # Expert parallelism: the experts' exchanges and their ops on the rows received (which
    # the runtime keeps, outside the graph's buffers) in the whole graph.
    {"model": "mixtral", "stage": 3, "ep": 2},
]
_BF16 = {
    "model": "gpt",
    "stage": 3,
    "precision": {"param": "bf16"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
}
# The second: updates on the host writing the bf16 copy into the program's host buffers.
BF16 = [_BF16, {**_BF16, "offload": {"optimizer": "cpu"}}]


def _pair(case: dict) -> tuple[dict, dict]:
    ours = {"world": 2, "steps": 3, "backend": "inductor", **case}
    return ours, {**ours, "backend": "eager"}


@functools.cache
def _results() -> list[dict]:
    return run_ranks(2, train, [c for case in [*FP32, *BF16] for c in _pair(case)])


@pytest.mark.parametrize("case", FP32, ids=lambda c: case_id({"world": 2, **c}))
def test_fp32_matches_the_eager_backend_and_the_reference(case):
    ours, eager = _pair(case)
    losses = [result[case_id(eager)]["losses"] for result in _results()]
    assert_trained_alike(_results(), ours, losses, _results()[0][case_id(eager)]["params"], 1e-5)
    if case["model"] != "gpt_dropout":
        assert_matches_reference(_results(), ours, 1e-5)


@pytest.mark.parametrize("case", [*FP32, *BF16], ids=lambda c: case_id({"world": 2, **c}))
def test_each_program_is_compiled_by_region(case):
    """Every compute region compiled (none run eagerly), the dropout GPT's included (its random
    ops run by ATen between the regions, in the program's order)."""
    compiled = re.compile(r"inductor: (\d+) of (\d+) compute regions compiled as \d+ graphs")
    for result in _results():
        notes = result[case_id(_pair(case)[0])]["backend_notes"]
        found = [m for note in notes if (m := compiled.match(note))]
        assert len(found) >= 1 and all(m[1] == m[2] for m in found), notes


@pytest.mark.parametrize("case", BF16, ids=lambda c: case_id({"world": 2, **c}))
def test_bf16_matches_the_reference_within_its_rounding(case):
    """Losses, weight matrices and the vector parameters as one vector within 1e-2
    (parity.COMPILED_LOW)."""
    assert_matches_reference(_results(), _pair(case)[0], 1e-2)
