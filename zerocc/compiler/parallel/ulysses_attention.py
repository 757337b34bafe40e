"""The all-to-all (DeepSpeed-Ulysses) form of context-parallel attention (issue 79).

Each of C ranks holds all heads of its own tokens (`CpLayout`'s order). One all-to-all swaps
that for all tokens of H/C heads: every rank then computes plain attention over the whole
sequence for its heads (`attention_blocks.block_forward`, one block, in fp32), and a second
all-to-all brings each rank its own tokens back with every head. The backward swaps the same
way around `block_backward`. The transfers go through ``all_to_all``, a callable that sends
the i-th tensor of a list to rank i and returns the list of what each rank sent this one; the
pass that uses this next will give it zerocc's all-to-all. Nothing here is reachable from a
plan yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from zerocc.compiler.parallel.attention_blocks import block_backward, block_forward, output_dot
from zerocc.compiler.parallel.ring_attention import CpLayout
from zerocc.errors import PlanError

AllToAll = Callable[[list[Tensor]], list[Tensor]]


def _to_heads(x: Tensor, layout: CpLayout, all_to_all: AllToAll) -> Tensor:
    """(B, H, T_local, D) of this rank's tokens -> (B, H/C, T, D) of its heads, in sequence
    order."""
    received = all_to_all(list(x.chunk(layout.cp, dim=1)))
    whole = x.new_empty(*received[0].shape[:2], layout.seq_len, *received[0].shape[3:])
    for sender, part in enumerate(received):
        whole[:, :, layout.token_indices(sender)] = part
    return whole


def _to_sequence(x: Tensor, layout: CpLayout, all_to_all: AllToAll) -> Tensor:
    """The inverse of `_to_heads`: (B, H/C, T, D) -> (B, H, T_local, D)."""
    parts = [x[:, :, layout.token_indices(r)] for r in range(layout.cp)]
    return torch.cat(all_to_all(parts), dim=1)


def _mask(
    layout: CpLayout, causal: bool, key_keep: Tensor | None, all_to_all: AllToAll
) -> Tensor | None:
    """The whole sequence's mask (True = attend): causal by position, and every rank's padding
    mask gathered (each rank sends its own to all)."""
    mask = None
    if causal:
        mask = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool).tril()
    if key_keep is not None:
        received = all_to_all([key_keep] * layout.cp)
        keep = key_keep.new_empty(key_keep.shape[0], layout.seq_len)
        for sender, part in enumerate(received):
            keep[:, layout.token_indices(sender)] = part
        keep = keep[:, None, None, :]
        mask = keep if mask is None else keep & mask
    return mask


def _check_heads(q: Tensor, layout: CpLayout) -> None:
    if q.shape[1] % layout.cp:
        raise PlanError(
            f"context parallelism (all-to-all): {q.shape[1]} attention heads do not divide "
            f"over cp={layout.cp} ranks (the heads must divide by cp; the ring form has no "
            "such limit)"
        )


def ulysses_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layout: CpLayout,
    causal: bool,
    all_to_all: AllToAll,
    key_keep: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """This rank's attention output over the whole sequence (its own tokens, every head, in
    q's dtype) and the log-sum-exp of its heads over every token (B, H/C, T), fp32, which
    `ulysses_attention_backward` takes."""
    _check_heads(q, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads = [_to_heads(t, layout, all_to_all) for t in (q, k, v)]
    out, lse = block_forward(*heads, scale, _mask(layout, causal, key_keep, all_to_all))
    return _to_sequence(out, layout, all_to_all).to(q.dtype), lse


def ulysses_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    *,
    layout: CpLayout,
    causal: bool,
    all_to_all: AllToAll,
    key_keep: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of this rank's own tokens, every head, each in its input's dtype."""
    _check_heads(q, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh, outh, douth = (_to_heads(t, layout, all_to_all) for t in (q, k, v, out, dout))
    mask = _mask(layout, causal, key_keep, all_to_all)
    grads = block_backward(qh, kh, vh, douth, lse, output_dot(outh, douth), scale, mask)
    return tuple(  # type: ignore[return-value]
        _to_sequence(g, layout, all_to_all).to(t.dtype)
        for g, t in zip(grads, (q, k, v), strict=True)
    )
