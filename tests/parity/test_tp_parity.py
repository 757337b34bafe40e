"""Parity of tensor parallelism beside ZeRO (``parallel.tp``): 4 gloo ranks as 2 data-parallel
× 2 tensor-parallel and 1 × 4 match one process training on the data-parallel ranks' batches,
step by step, for every ZeRO stage (4 × 1 is ZeRO alone: tests/parity/test_parity.py), and
8 ranks as 2 replicas × 2 shards × 2 tensor-parallel. The example GPT and a Hugging Face Llama
are split as Megatron splits them (``models.TP_LAYERS``); the GPT with dropout in its split
attention too, drawn by key (``capture.draws: keyed``).

Tolerance 1e-5 relative, as tests/parity/test_parity.py: a rowwise layer's output is the sum of
the tp ranks' partial matmuls, and an input gradient the sum of theirs, another association of
the same float32 sums, a few ulps per step, and the vocabulary-parallel cross-entropy sums its
exponentials per rank. A wrong split (a missing all-reduce, a rank holding the wrong slice, a
replicated weight counted twice in the clip's norm) differs by 1e-3 or more.

Cases marked ``slow`` (run with ``pytest --slow``) are covered by the others: each stage, tp
degree, bf16 and the passes are trained by another case of the default run.

bf16 compute: the tp all-reduces sum bf16 partial results, each rounded on its rank, where the
unsplit recipe rounds one fp32-accumulated matmul once, and the vocabulary-parallel loss
computes in fp32 where torch's cross-entropy of bf16 logits rounds: against the plain bf16
recipe the weights differed by 0.6-1.5% after 5 AdamW steps. The reference here computes as the
ranks round (tests/tp_emulation.py: partial matmuls summed in bf16, slices of colwise outputs
apart, the loss in fp32): the GPT matched to the bit on this CPU, the Llama within 4.5e-6
(fp32 sums of its update in another order); held to the fp32 tolerance. Not covered: bf16 with
sequence parallelism, whose norm gradients are sums of the ranks' rounded partial sums, which
the emulation does not round alike.
"""

from __future__ import annotations

import pytest
from multirank import run_ranks

from parity import assert_matches_reference, case_id, is_slow, of_speed, run_once, sweep, train

TOL = 1e-5
CLIPPED = {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "grad_clip": 0.05}
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
CASES = [
    {"model": "gpt", "stage": 3, "world": 4, "tp": 2, "optimizer": CLIPPED},
    {"model": "gpt", "stage": 2, "world": 4, "tp": 2, "accum": 2, "slow": True},
    {"model": "gpt", "stage": 1, "world": 4, "tp": 2, "optimizer": SGD, "slow": True},
    {"model": "gpt", "stage": 0, "world": 4, "tp": 2, "optimizer": CLIPPED},
    {"model": "gpt4h", "stage": 3, "world": 4, "tp": 4, "optimizer": CLIPPED},
    {"model": "gpt4h", "stage": 0, "world": 4, "tp": 4, "slow": True},
    # composes with the other passes
    {"model": "gpt", "stage": 3, "world": 4, "tp": 2, "recompute": {"units": "all"}},
    {"model": "gpt", "stage": 3, "world": 4, "tp": 2, "overlap": {"bucket_mb": 64}, "slow": True},
    {"model": "gpt", "stage": 2, "world": 4, "tp": 2, "offload": {"optimizer": "cpu"}},
    # sequence parallelism: between the split layers each rank holds its chunk of the tokens
    {"model": "gpt", "stage": 3, "world": 4, "tp": 2, "sp": True, "optimizer": CLIPPED},
    {"model": "gpt", "stage": 1, "world": 4, "tp": 2, "sp": True, "accum": 2},
    {"model": "gpt4h", "stage": 2, "world": 4, "tp": 4, "sp": True},
    # bf16 compute, against a reference that rounds the tp ranks' partial sums as they do
    {"model": "gpt", "stage": 3, "world": 4, "tp": 2, "precision": {"param": "bf16"},
     "slow": True},
    # a Hugging Face Llama (transformers' code as it is), every stage, bf16 too
    {"model": "llama", "stage": 0, "world": 4, "tp": 2, "optimizer": CLIPPED, "slow": True},
    {"model": "llama", "stage": 1, "world": 4, "tp": 2, "sp": True},
    {"model": "llama", "stage": 2, "world": 4, "tp": 2, "accum": 2},
    {"model": "llama", "stage": 3, "world": 4, "tp": 2, "precision": {"param": "bf16"}},
    # A mixture of experts: attention split, each layer's experts an opaque region beside it
    {"model": "mixtral", "stage": 3, "world": 4, "tp": 2},
    # ... its experts on each rank's chunk of the sequence: their gradients summed over tp
    {"model": "mixtral_no_router_loss", "stage": 2, "world": 4, "tp": 2, "sp": True},
    # Inductor's whole graph (its fp32 tolerance is the same, see test_inductor_parity.py)
    {"model": "gpt", "stage": 3, "world": 4, "tp": 2, "sp": True, "backend": "inductor-whole"},
    # dropout inside the split attention, drawn by key: each rank keeps its heads' part of
    # the mask one process draws (zerocc/compiler/parallel/split_draws.py); recomputed
    {"model": "gpt_dropout", "stage": 3, "world": 4, "tp": 2, "keyed": True,
     "recompute": {"units": "all"}, "optimizer": CLIPPED},
    {"model": "llama_dropout", "stage": 1, "world": 4, "tp": 2, "sp": True, "keyed": True},
    # a cross-entropy with label smoothing reads the head's gathered logits
    {"model": "smoothed", "stage": 3, "world": 4, "tp": 2},
]


@run_once
def _results(slow: bool = False) -> list[dict]:
    return run_ranks(4, train, of_speed(CASES, slow))


@pytest.mark.parametrize("case", sweep(CASES), ids=case_id)
def test_tensor_parallelism_matches_unsharded_training(case):
    assert_matches_reference(_results(is_slow(case)), case, TOL)


def test_inductor_compiles_a_tensor_parallel_step_as_one_graph():
    case = next(c for c in CASES if c.get("backend") == "inductor-whole")
    notes = _results()[0][case_id(case)]["backend_notes"]
    assert any("whole program compiled as one graph" in n for n in notes), notes


def test_the_ranks_of_a_tp_group_hold_slices_and_move_bytes_on_their_group():
    """Per step and rank at 2 × 2: the ZeRO collectives move the rank's slices over its dp
    group, and the tp group carries the layers' all-reduces and the logits' gather."""
    result = _results()[0][case_id(CASES[0])]
    elements = result["elements"]
    assert elements["all_gather (tp)"] > 0 and elements["all_reduce (tp)"] > 0, elements
    assert elements["reduce_scatter"] == result["psi"], elements  # the slices' Ψ, over dp


HYBRID = {"model": "gpt", "stage": 3, "world": 8, "tp": 2, "replicate": 2, "optimizer": CLIPPED}


def test_hybrid_sharding_beside_tensor_parallelism_matches_unsharded_training():
    """8 ranks as 2 replicas × 2 shards × 2 tensor-parallel: every mesh dimension at once."""
    assert_matches_reference(run_ranks(8, train, [HYBRID]), HYBRID, TOL)
