"""Collectives in int8 (ZeRO++'s qwZ and qgZ): ``zero.quantized_weights: int8`` for stage 3's
all-gathers of parameters, ``zero.quantized_grads: int8`` for the reduce-scatters of gradients.

Values are quantized in blocks of ``block`` elements of one rank's shard (the last one shorter
where the shard is not a multiple), one fp32 scale per block, the block's largest magnitude
over 127, so no scale straddles two shards. A value moves 1 byte instead of 4 (fp32) or 2
(bf16), plus 4 bytes per block, and comes back within half a step (``scale / 2``) of what was
sent; a block of zeros has scale 0 and comes back as zeros.

- **All-gather**: each rank quantizes its shard; the int8 values and the scales are
  all-gathered (two collectives, issued together); the wait dequantizes into the full flat
  parameter in the shard's dtype.
- **Reduce-scatter**: each rank quantizes each destination's chunk of its full gradient; the
  chunks and their scales go by all-to-all (rank ``r`` receives every rank's chunk ``r``); the
  wait dequantizes them and sums them in fp32, in rank order (the same sum on every rank),
  into the shard, in the gradient's dtype. Each rank's contribution is rounded once, before the
  sum, as qgZ's all-to-all does (not once per hop of a ring).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerocc.engine.comm import Comm, Work

LEVELS = 127  # int8's symmetric range: -127..127


def blocks_of(numel: int, block: int) -> int:
    """Blocks a shard of ``numel`` elements is quantized in."""
    return -(-numel // block)


def quantize_rows(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` (one shard each) as int8 values and one fp32 scale per block of
    ``block`` elements: ``(q [rows, numel], scales [rows, blocks])``."""
    count, numel = rows.shape[0], rows.shape[1]
    blocks = blocks_of(numel, block)
    padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=rows.device)
    padded[:, :numel] = rows
    grouped = padded.view(count, blocks, block)
    scales = grouped.abs().amax(dim=2) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grouped / safe[..., None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return q.view(count, -1)[:, :numel].contiguous(), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The fp32 values of int8 rows ``q`` [rows, numel] with their blocks' ``scales``."""
    count, numel = q.shape
    blocks = scales.shape[1]
    values = torch.zeros(count, blocks * block, dtype=torch.float32, device=q.device)
    values[:, :numel] = q
    return (values.view(count, blocks, block) * scales[..., None]).view(count, -1)[:, :numel]


def quantize(shard: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``shard`` (flat) as int8 values and one fp32 scale per block of ``block`` elements."""
    q, scales = quantize_rows(shard.view(1, -1), block)
    return q.view(-1), scales.view(-1)


def dequantize_into(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, world_size: int, block: int
) -> None:
    """Write the ``world_size`` gathered shards (``q``: their int8 values end to end,
    ``scales``: their blocks' scales end to end) into the flat ``out``, in its dtype."""
    rows = dequantize_rows(q.view(world_size, -1), scales.view(world_size, -1), block)
    out.view(world_size, -1).copy_(rows)


class _Then(Work):
    """Collectives issued together; waiting on them runs ``then`` (the dequantization). It
    holds the tensors they read and write until then (on a GPU they run on the communication
    stream)."""

    def __init__(self, works: list[Work], then: Callable[[], None], held: list) -> None:
        super().__init__()
        self._works, self._then, self._held = works, then, held

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._then()
        self._held = []


def all_gather_int8(
    comm: Comm, shard: torch.Tensor, world_size: int, block: int
) -> tuple[torch.Tensor, Work]:
    """Issue the int8 all-gather of ``shard`` over ``comm``: the full flat parameter (in the
    shard's dtype, written when the returned work is waited on) and that work."""
    q, scales = quantize(shard, block)
    q_all = q.new_empty(q.numel() * world_size)
    scales_all = scales.new_empty(scales.numel() * world_size)
    works = [comm.all_gather(q_all, q), comm.all_gather(scales_all, scales)]
    out = shard.new_empty(shard.numel() * world_size)

    def then() -> None:
        dequantize_into(out, q_all, scales_all, world_size, block)

    return out, _Then(works, then, [q, scales, q_all, scales_all])


def reduce_scatter_int8(
    comm: Comm, full: torch.Tensor, world_size: int, block: int
) -> tuple[torch.Tensor, Work]:
    """Issue the int8 reduce-scatter of the flat ``full`` over ``comm``: this rank's shard of
    the sum over ranks (in ``full``'s dtype, written when the returned work is waited on) and
    that work."""
    q, scales = quantize_rows(full.view(world_size, -1), block)
    q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)
    numel, blocks = q.shape[1], scales.shape[1]
    works = [
        comm.all_to_all(q_in.view(-1), q.view(-1), [numel] * world_size, [numel] * world_size),
        comm.all_to_all(
            scales_in.view(-1), scales.view(-1), [blocks] * world_size, [blocks] * world_size
        ),
    ]
    out = full.new_empty(numel)

    def then() -> None:
        out.copy_(dequantize_rows(q_in, scales_in, block).sum(dim=0))

    return out, _Then(works, then, [q, scales, q_in, scales_in])
