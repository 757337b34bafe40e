"""The offload rates `zerocc profile` measures on a GPU machine (zerocc/inspect/host_rates.py):
the host update's rate counts the bytes the cost model counts for an update, so the model,
given that rate, predicts the measured update's time. (The host link needs a GPU:
tests/test_cuda.py measures it.)"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from zerocc.cost.model import node_work
from zerocc.inspect.host_rates import ADAMW_BYTES_PER_ELEMENT, host_update_rate


def _adamw_node(numel: int) -> fx.Node:
    """An update node of a program: AdamW on ``numel`` fp32 elements with a bf16 copy."""
    graph = fx.Graph()

    def tensor(name: str, shape: tuple, dtype: torch.dtype) -> fx.Node:
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    names = ("param", "grad", "exp_avg", "exp_avg_sq")
    param, grad, exp_avg, exp_avg_sq = (tensor(n, (numel,), torch.float32) for n in names)
    step, lr = tensor("step", (), torch.int64), tensor("lr", (), torch.float64)
    copy = tensor("copy", (numel,), torch.bfloat16)
    args = (param, grad, exp_avg, exp_avg_sq, step, None, None, copy, 1.0, lr, 0.9, 0.999, 1e-8,
            0.0, [], False)  # fmt: skip
    return graph.call_function(torch.ops.zerocc.adamw_.default, args)


def test_the_measured_update_rate_counts_the_bytes_the_cost_model_counts():
    numel = 1 << 16
    measured = host_update_rate(numel, reps=2)
    modeled = node_work(_adamw_node(numel)).bytes
    assert modeled == pytest.approx(ADAMW_BYTES_PER_ELEMENT * numel, abs=64)  # + the scalars
    assert measured["bytes_per_s"] > 0 and measured["numel"] == numel
    assert measured["kernels"] in ("one-pass", "fused", "torch")
