"""Ring attention over the ranks of a context-parallel group (issue 79, the first pieces).

Each of the C ranks holds the queries, keys and values of its own tokens (`CpLayout`: the
sequence cut into 2*C chunks, rank r holding chunks r and 2C-1-r when balanced, so that causal
attention gives every rank the same work). The forward walks the ring: at each of C steps a
rank attends its queries to the K/V chunk it holds, merges the block into its running result
by log-sum-exp (`attention_blocks.merge_partials`) and passes the K/V on to the next rank. The
backward walks it again: dQ stays with the rank, while each K/V chunk travels with the dK/dV
accumulated for it and, after C steps, arrives back at its owner with its whole gradient.

A block entirely above the causal diagonal (every key after every query) is skipped, not
computed. The transfers go through ``exchange``, a callable that sends a tuple of tensors to
rank r+1 and returns the one rank r-1 sent: a test simulates the ring in one process; the pass
that uses this next will give it zerocc's comm. Nothing here is reachable from a plan yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from zerocc.compiler.parallel.attention_blocks import (
    block_backward,
    block_forward,
    merge_partials,
    output_dot,
)
from zerocc.errors import PlanError

Exchange = Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]]
BlockKind = Literal["full", "diagonal", "skip"]


@dataclass(frozen=True)
class CpLayout:
    """Which tokens of a sequence of ``seq_len`` each of ``cp`` ranks holds. ``balanced``: the
    sequence in 2*cp chunks, rank r holding chunks r and 2cp-1-r; otherwise rank r holds the
    r-th of cp contiguous chunks."""

    seq_len: int
    cp: int
    balanced: bool = True

    def __post_init__(self) -> None:
        parts = 2 * self.cp if self.balanced else self.cp
        if self.cp < 1 or self.seq_len % parts:
            raise PlanError(
                f"context parallelism: a sequence of {self.seq_len} tokens cannot be cut into "
                f"{parts} equal chunks for cp={self.cp} (the length must divide by "
                f"{'2*cp' if self.balanced else 'cp'})"
            )

    def segments(self, rank: int) -> list[tuple[int, int]]:
        """The rank's tokens as (first position, length) runs, in the order the rank holds
        them."""
        if self.balanced:
            chunk = self.seq_len // (2 * self.cp)
            return [(rank * chunk, chunk), ((2 * self.cp - 1 - rank) * chunk, chunk)]
        chunk = self.seq_len // self.cp
        return [(rank * chunk, chunk)]

    def token_indices(self, rank: int) -> Tensor:
        """The global positions of the rank's tokens, in its order: what it gathers from the
        sequence (``x[:, idx]``) and what it indexes rotary tables with."""
        return torch.cat([torch.arange(s, s + n) for s, n in self.segments(rank)])


def block_kind(q_segment: tuple[int, int], k_segment: tuple[int, int], causal: bool) -> BlockKind:
    """How a block of queries over a block of keys is computed: ``skip`` when every key comes
    after every query under a causal mask, ``full`` when no key does (or no mask), otherwise
    ``diagonal`` (masked by position)."""
    if not causal:
        return "full"
    (q_start, q_len), (k_start, k_len) = q_segment, k_segment
    if k_start > q_start + q_len - 1:
        return "skip"
    if k_start + k_len - 1 <= q_start:
        return "full"
    return "diagonal"


def attention_flops(layout: CpLayout, rank: int, causal: bool, head_dim: int = 1) -> int:
    """Multiply-adds the rank's two attention matmuls compute over the whole ring (per batch
    and head), counting the blocks `block_kind` does not skip."""
    total = 0
    for owner in range(layout.cp):
        for qs in layout.segments(rank):
            for ks in layout.segments(owner):
                if block_kind(qs, ks, causal) != "skip":
                    total += 2 * qs[1] * ks[1] * head_dim
    return total


def _causal_mask(q_segment: tuple[int, int], k_segment: tuple[int, int]) -> Tensor:
    """(Tq, Tk) True where the key's position is at or before the query's."""
    q_pos = torch.arange(q_segment[0], q_segment[0] + q_segment[1])
    k_pos = torch.arange(k_segment[0], k_segment[0] + k_segment[1])
    return k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)


def _blocks(
    layout: CpLayout, rank: int, owner: int, causal: bool, key_keep: Tensor | None
) -> Iterator[tuple[slice, slice, Tensor | None]]:
    """The blocks of this rank's queries over ``owner``'s keys that are computed: (query
    slice, key slice, mask or None) in local token offsets. ``key_keep`` (B, Tk_local), True
    = attend, is the owner's padding mask."""
    q_offset = 0
    for qs in layout.segments(rank):
        k_offset = 0
        for ks in layout.segments(owner):
            kind = block_kind(qs, ks, causal)
            if kind != "skip":
                mask = _causal_mask(qs, ks) if kind == "diagonal" else None
                if key_keep is not None:
                    keep = key_keep[:, k_offset : k_offset + ks[1]][:, None, None, :]
                    mask = keep if mask is None else keep & mask
                yield slice(q_offset, q_offset + qs[1]), slice(k_offset, k_offset + ks[1]), mask
            k_offset += ks[1]
        q_offset += qs[1]


def ring_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    rank: int,
    layout: CpLayout,
    causal: bool,
    exchange: Exchange,
    key_keep: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """This rank's attention output (in q's dtype) and log-sum-exp (fp32) over the whole
    sequence's keys, ``q``, ``k``, ``v`` (B, H, T_local, D) being its own tokens in
    ``layout``'s order. ``key_keep`` (B, T_local): the padding mask of this rank's keys."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    held = (k, v) if key_keep is None else (k, v, key_keep)
    for step in range(layout.cp):
        owner = (rank - step) % layout.cp
        keep = held[2] if key_keep is not None else None
        for q_part, k_part, mask in _blocks(layout, rank, owner, causal, keep):
            b_out, b_lse = block_forward(
                q[:, :, q_part], held[0][:, :, k_part], held[1][:, :, k_part], scale, mask
            )
            out[:, :, q_part], lse[:, :, q_part] = merge_partials(
                out[:, :, q_part], lse[:, :, q_part], b_out, b_lse
            )
        if step < layout.cp - 1:
            held = exchange(held)
    return out.to(q.dtype), lse


def ring_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    *,
    rank: int,
    layout: CpLayout,
    causal: bool,
    exchange: Exchange,
    key_keep: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of this rank's own tokens (each in its input's dtype), from the forward's
    ``out`` and ``lse``. dK/dV travel the ring with their K/V and come home after C steps."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    delta = output_dot(out, dout)
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    held = (k, v, dk, dv) if key_keep is None else (k, v, dk, dv, key_keep)
    for step in range(layout.cp):
        owner = (rank - step) % layout.cp
        k_held, v_held, dk_held, dv_held = held[:4]
        keep = held[4] if key_keep is not None else None
        for q_part, k_part, mask in _blocks(layout, rank, owner, causal, keep):
            b_dq, b_dk, b_dv = block_backward(
                q[:, :, q_part],
                k_held[:, :, k_part],
                v_held[:, :, k_part],
                dout[:, :, q_part],
                lse[:, :, q_part],
                delta[:, :, q_part],
                scale,
                mask,
            )
            dq[:, :, q_part] += b_dq
            dk_held[:, :, k_part] += b_dk
            dv_held[:, :, k_part] += b_dv
        if step < layout.cp - 1:
            held = exchange(held)
    # One more shift carries only the gradients home: their owner holds its own K/V.
    dk_home, dv_home = exchange((dk_held, dv_held)) if layout.cp > 1 else (dk_held, dv_held)
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)
