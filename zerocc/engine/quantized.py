"""Quantized collectives (ZeRO++'s qwZ and qgZ): ``zero.quantized_weights: int8 | fp8`` for
stage 3's all-gathers of parameters, ``zero.quantized_grads: int8 | int4`` for the
reduce-scatters of gradients. The formats and their bytes are :mod:`zerocc.ir.wire`'s.

Values are quantized in blocks of ``block`` elements of one rank's shard (the last one shorter
where the shard is not a multiple), one fp32 scale per block, the block's largest magnitude
over the format's ``top``, so no scale straddles two shards. A block of zeros has scale 0 and
comes back as zeros. What comes back:

- ``int8`` (-127..127) and ``int4`` (-7..7): within half a step (``scale / 2``) of what was
  sent;
- ``fp8`` (float8 e4m3, scaled to 448 at most): within 2^-4 of a value's magnitude (half a unit
  of its 3-bit mantissa), and within ``scale · 2^-10`` near zero (its smallest step).

On the wire a payload is bytes (``uint8``): every process group carries them, where not every
one carries float8. ``int4`` packs two values to a byte, low nibble first.

- **All-gather**: each rank quantizes its shard; the payloads and the scales are all-gathered
  (two collectives, issued together); the wait dequantizes into the full flat parameter in the
  shard's dtype.
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
from zerocc.ir.wire import WireFormat, blocks_of


def encode(scaled: torch.Tensor, wire: WireFormat) -> torch.Tensor:
    """Rows of values already scaled into ``[-top, top]`` as the format's bytes:
    ``uint8 [rows, payload_bytes(numel)]``."""
    clamped = scaled.clamp(-wire.top, wire.top)
    if wire.name == "fp8":
        return clamped.to(torch.float8_e4m3fn).view(torch.uint8)
    steps = torch.round(clamped).to(torch.int16)
    if wire.name == "int8":
        return steps.to(torch.int8).view(torch.uint8)
    nibbles = (steps + 8).to(torch.uint8)  # int4: 1..15, 8 standing for 0
    if nibbles.shape[1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def decode(payload: torch.Tensor, numel: int, wire: WireFormat) -> torch.Tensor:
    """The scaled values ``encode`` wrote into ``payload`` (rows of ``numel``), in fp32."""
    if wire.name == "fp8":
        return payload.view(torch.float8_e4m3fn).float()
    if wire.name == "int8":
        return payload.view(torch.int8).float()
    low, high = payload & 15, payload >> 4
    nibbles = torch.stack((low, high), dim=2).view(payload.shape[0], -1)[:, :numel]
    return nibbles.float() - 8


def quantize_rows(
    rows: torch.Tensor, block: int, wire: WireFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` (one shard each) as the format's bytes and one fp32 scale per block
    of ``block`` elements: ``(payload [rows, bytes], scales [rows, blocks])``."""
    count, numel = rows.shape[0], rows.shape[1]
    blocks = blocks_of(numel, block)
    padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=rows.device)
    padded[:, :numel] = rows
    grouped = padded.view(count, blocks, block)
    scales = grouped.abs().amax(dim=2) / wire.top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = (grouped / safe[..., None]).view(count, -1)[:, :numel]
    return encode(scaled, wire).contiguous(), scales


def dequantize_rows(
    payload: torch.Tensor, scales: torch.Tensor, block: int, numel: int, wire: WireFormat
) -> torch.Tensor:
    """The fp32 values of ``payload``'s rows of ``numel`` with their blocks' ``scales``."""
    count, blocks = scales.shape
    values = torch.zeros(count, blocks * block, dtype=torch.float32, device=payload.device)
    values[:, :numel] = decode(payload, numel, wire)
    return (values.view(count, blocks, block) * scales[..., None]).view(count, -1)[:, :numel]


def quantize(
    shard: torch.Tensor, block: int, wire: WireFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """``shard`` (flat) as the format's bytes and one fp32 scale per block of ``block``."""
    payload, scales = quantize_rows(shard.view(1, -1), block, wire)
    return payload.view(-1), scales.view(-1)


def dequantize_into(
    out: torch.Tensor,
    payload: torch.Tensor,
    scales: torch.Tensor,
    world_size: int,
    block: int,
    wire: WireFormat,
) -> None:
    """Write the ``world_size`` gathered shards (``payload``: their bytes end to end,
    ``scales``: their blocks' scales end to end) into the flat ``out``, in its dtype."""
    numel = out.numel() // world_size
    rows = dequantize_rows(
        payload.view(world_size, -1), scales.view(world_size, -1), block, numel, wire
    )
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


def all_gather_quantized(
    comm: Comm, shard: torch.Tensor, world_size: int, block: int, wire: WireFormat
) -> tuple[torch.Tensor, Work]:
    """Issue the quantized all-gather of ``shard`` over ``comm``: the full flat parameter (in
    the shard's dtype, written when the returned work is waited on) and that work."""
    payload, scales = quantize(shard, block, wire)
    payload_all = payload.new_empty(payload.numel() * world_size)
    scales_all = scales.new_empty(scales.numel() * world_size)
    works = [comm.all_gather(payload_all, payload), comm.all_gather(scales_all, scales)]
    out = shard.new_empty(shard.numel() * world_size)

    def then() -> None:
        dequantize_into(out, payload_all, scales_all, world_size, block, wire)

    return out, _Then(works, then, [payload, scales, payload_all, scales_all])


def reduce_scatter_quantized(
    comm: Comm, full: torch.Tensor, world_size: int, block: int, wire: WireFormat
) -> tuple[torch.Tensor, Work]:
    """Issue the quantized reduce-scatter of the flat ``full`` over ``comm``: this rank's shard
    of the sum over ranks (in ``full``'s dtype, written when the returned work is waited on)
    and that work."""
    numel = full.numel() // world_size
    payload, scales = quantize_rows(full.view(world_size, -1), block, wire)
    payload_in, scales_in = torch.empty_like(payload), torch.empty_like(scales)
    nbytes, blocks = payload.shape[1], scales.shape[1]
    works = [
        comm.all_to_all(
            payload_in.view(-1), payload.view(-1), [nbytes] * world_size, [nbytes] * world_size
        ),
        comm.all_to_all(
            scales_in.view(-1), scales.view(-1), [blocks] * world_size, [blocks] * world_size
        ),
    ]
    out = full.new_empty(numel)

    def then() -> None:
        out.copy_(dequantize_rows(payload_in, scales_in, block, numel, wire).sum(dim=0))

    return out, _Then(works, then, [payload, scales, payload_in, scales_in])
