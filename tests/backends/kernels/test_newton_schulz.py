"""Muon's math (zerocc/backends/kernels/newton_schulz.py) against torch.optim.Muon, one process:
the ops on a flat buffer (momentum, orthogonalization, weight update) give torch's weights bit
for bit, for one matrix, a tall one, without nesterov, and for an expert stack [E, d, f] each
expert as torch's Muon of its own [d, f]."""

from __future__ import annotations

import pytest
import torch

from zerocc.backends.kernels import newton_schulz as ns
from zerocc.ir.owned_update_ops import MATRIX_FIELDS

HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}


def _torch_muon(weights: torch.Tensor, grads: list[torch.Tensor], **kw) -> torch.Tensor:
    """``weights`` after torch.optim.Muon's steps on ``grads`` (one per step)."""
    param = torch.nn.Parameter(weights.clone())
    opt = torch.optim.Muon([param], **HYPER, **kw)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    return param.detach()


def _ours(weights: torch.Tensor, grads: list[torch.Tensor], nesterov=True, adjust=None):
    """The same steps through zerocc's ops on the matrix's flat buffer (one rank: owner -1)."""
    shape = weights.shape
    param, buf = weights.clone().reshape(-1), torch.zeros(weights.numel())
    batch = 1 if weights.dim() == 2 else shape[0]
    matrices = [0, batch, shape[-2], shape[-1], -1]
    assert len(matrices) == len(MATRIX_FIELDS)
    ratio = ns.adjusted_ratio(adjust, tuple(shape))
    lr = torch.tensor(HYPER["lr"], dtype=torch.float64)
    rank = torch.tensor(0)
    for grad in grads:
        update = torch.ops.zerocc.muon_momentum_(
            buf, grad.reshape(-1), None, None, 1.0, HYPER["momentum"], nesterov
        )
        ortho = torch.ops.zerocc.muon_orthogonalize(
            update, rank, matrices, list(ns.NS_COEFFICIENTS), ns.NS_STEPS, ns.NS_EPS
        )
        torch.ops.zerocc.muon_apply_(
            param, ortho, None, None, lr, HYPER["weight_decay"], None,
            [0, param.numel()], [ratio],
        )  # fmt: skip
    return param.view(shape)


@pytest.mark.parametrize(
    "shape, kw",
    [
        ((16, 24), {}),
        ((40, 12), {}),  # tall: orthogonalized transposed, its rate scaled by sqrt(40/12)
        ((16, 24), {"nesterov": False}),
        ((40, 12), {"adjust_lr_fn": "match_rms_adamw"}),
    ],
)
def test_matrix_matches_torch_muon(shape, kw):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    expected = _torch_muon(weights, grads, **kw)
    got = _ours(weights, grads, kw.get("nesterov", True), kw.get("adjust_lr_fn"))
    assert torch.equal(got, expected)
    assert not torch.equal(got, weights)


def test_expert_stack_is_each_experts_muon():
    gen = torch.Generator().manual_seed(1)
    stack = torch.randn(3, 8, 20, generator=gen)
    grads = [torch.randn(3, 8, 20, generator=gen) for _ in range(2)]
    got = _ours(stack, grads)
    for e in range(3):
        assert torch.equal(got[e], _torch_muon(stack[e], [g[e] for g in grads])), e


def test_orthogonalize_matches_torch_and_refuses_vectors():
    from torch.optim._muon import _zeropower_via_newtonschulz

    m = torch.randn(12, 7)
    assert torch.equal(
        ns.orthogonalize(m), _zeropower_via_newtonschulz(m, ns.NS_COEFFICIENTS, 5, ns.NS_EPS)
    )
    with pytest.raises(ValueError, match="matrices"):
        ns.orthogonalize(torch.randn(5))


def test_only_the_owner_orthogonalizes():
    full = torch.randn(2 * 6 * 4)
    matrices = [0, 1, 6, 4, 0, 24, 1, 6, 4, 1]  # the first owned by rank 0, the second by 1
    args = (matrices, list(ns.NS_COEFFICIENTS), 5, ns.NS_EPS)
    on0 = torch.ops.zerocc.muon_orthogonalize(full, torch.tensor(0), *args)
    on1 = torch.ops.zerocc.muon_orthogonalize(full, torch.tensor(1), *args)
    assert torch.count_nonzero(on0[24:]) == 0 and torch.count_nonzero(on1[:24]) == 0
    assert torch.equal(on0[:24], ns.orthogonalize(full[:24].view(6, 4)).float().reshape(-1))
    assert torch.equal(
        on0 + on1,
        torch.ops.zerocc.muon_orthogonalize(
            full, torch.tensor(0), [0, 1, 6, 4, -1, 24, 1, 6, 4, -1], *args[1:]
        ),
    )


def test_apply_updates_only_this_shards_part_and_skips_on_overflow():
    param = torch.ones(8)
    ortho = torch.ones(8)
    lr = torch.tensor(0.5, dtype=torch.float64)
    # the matrix spans flat elements 2..9; this rank's shard is elements 4..7 (rank 1 of 4)
    torch.ops.zerocc.muon_apply_(param[:4], ortho[:4], None, None, lr, 0.0, torch.tensor(1),
                                 [2, 8], [1.0])  # fmt: skip
    assert param[:4].tolist() == [0.5] * 4 and param[4:].tolist() == [1.0] * 4
    torch.ops.zerocc.muon_apply_(param, ortho, torch.tensor(1.0), None, lr, 0.0, None, [0, 8],
                                 [1.0])  # fmt: skip
    assert param[:4].tolist() == [0.5] * 4


def test_flops_count_every_step():
    assert ns.newton_schulz_flops((4, 8), steps=1) == 4 * 4 * 4 * 8 + 2 * 4**3
    assert ns.newton_schulz_flops((3, 8, 4)) == 3 * ns.newton_schulz_flops((8, 4))
