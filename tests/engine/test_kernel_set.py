"""The kernel-set interface (zerocc/engine/kernel_set.py): AdamW's scalars are one record,
:class:`AdamWHyper`, that every set's ``adamw_`` takes after the tensors (issue 78: the
14-argument signature was written five times). tests/backends/kernels holds each set to the
interface and to the reference's numbers."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from zerocc.backends.kernels import reference
from zerocc.engine.kernel_set import AdamWHyper, KernelSet

TENSORS = ["param", "grad", "exp_avg", "exp_avg_sq", "step", "grad_coef", "found_inf",
           "param_copy"]  # fmt: skip


def test_adamw_takes_its_tensors_then_one_record_of_scalars():
    parameters = list(inspect.signature(KernelSet.adamw_).parameters.values())[1:]
    assert [p.name for p in parameters] == [*TENSORS, "hyper"]
    assert parameters[-1].annotation == "AdamWHyper"


def test_the_record_is_frozen_and_named():
    hyper = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    assert hyper.grad_scale == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        hyper.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1)  # type: ignore[misc]  (by name only)


def test_the_reference_update_through_the_record_is_torchs_adamw():
    """One step, bit for bit ``torch.optim.AdamW`` (foreach off): what the record carries
    reaches the arithmetic, each scalar where it was."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(1000, generator=gen)
    grad = torch.randn(1000, generator=gen)
    theirs = torch.nn.Parameter(param.clone())
    theirs.grad = grad * 0.5
    optim = torch.optim.AdamW([theirs], lr=3e-2, betas=(0.8, 0.95), eps=1e-6,
                              weight_decay=0.1, foreach=False)  # fmt: skip
    for _ in range(2):
        optim.step()
    ours, m, v = param.clone(), torch.zeros(1000), torch.zeros(1000)
    hyper = AdamWHyper(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, grad_scale=0.5)
    for step in (1, 2):
        reference.adamw_(ours, grad, m, v, torch.tensor(step), None, None, None, hyper)
    assert torch.equal(ours, theirs.detach())
