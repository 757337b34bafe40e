"""Stage 3's all-gather of parameters in int8 (``zero.quantized_weights: int8``, ZeRO++'s qwZ).

Each rank quantizes its own shard in blocks of ``block`` elements (the last one shorter where
the shard is not a multiple), one fp32 scale per block, the block's largest magnitude over 127,
so no scale straddles two ranks' shards. The int8 values and the scales are all-gathered (two
collectives, issued together), and dequantized into the full flat parameter when the gather is
waited on: ``q * scale`` in fp32, cast to the shard's dtype. A weight moves 1 byte instead of 4
(fp32) or 2 (bf16), plus 4 bytes per block, and comes back rounded to within half a step
(``scale / 2``) of its value; a block of zeros has scale 0 and comes back as zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerocc.engine.comm import Comm, Work

LEVELS = 127  # int8's symmetric range: -127..127


def blocks_of(numel: int, block: int) -> int:
    """Blocks a shard of ``numel`` elements is quantized in."""
    return -(-numel // block)


def quantize(shard: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``shard`` (flat) as int8 values and one fp32 scale per block of ``block`` elements."""
    numel, count = shard.numel(), blocks_of(shard.numel(), block)
    padded = torch.zeros(count * block, dtype=torch.float32, device=shard.device)
    padded[:numel] = shard
    rows = padded.view(count, block)
    scales = rows.abs().amax(dim=1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return q.view(-1)[:numel].contiguous(), scales


def dequantize_into(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, world_size: int, block: int
) -> None:
    """Write the ``world_size`` gathered shards (``q``: their int8 values end to end,
    ``scales``: their blocks' scales end to end) into the flat ``out``, in its dtype."""
    numel = q.numel() // world_size
    count = blocks_of(numel, block)
    values = torch.zeros(world_size, count * block, dtype=torch.float32, device=q.device)
    values[:, :numel] = q.view(world_size, numel)
    values = values.view(world_size, count, block) * scales.view(world_size, count, 1)
    out.view(world_size, numel).copy_(values.view(world_size, -1)[:, :numel])


class _Dequantized(Work):
    """The two gathers of a quantized all-gather; waiting on it dequantizes into the output.
    It holds the tensors the gathers read and write until then (on a GPU they run on the
    communication stream)."""

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

    return out, _Dequantized(works, then, [q, scales, q_all, scales_all])
