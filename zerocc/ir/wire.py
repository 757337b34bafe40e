"""Wire formats of the quantized collectives (ZeRO++'s qwZ and qgZ): what a value costs on the
wire in each, for the passes that count a collective's bytes and the engine that encodes it.

A quantized collective sends each rank's shard in blocks of :data:`QUANT_BLOCK` elements, each
block with one fp32 scale (its largest magnitude over the format's :attr:`WireFormat.top`), so
that no scale straddles two ranks' shards:

- ``int8``: a value rounded to one of 255 steps (-127..127), 1 byte;
- ``fp8``: a value cast to float8 e4m3 (448 at most, 3 mantissa bits), 1 byte: no worse than
  int8 near the block's largest values, much finer near zero;
- ``int4``: a value rounded to one of 15 steps (-7..7), two to a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANT_BLOCK = 256  # elements per fp32 scale
SCALE_BYTES = 4


@dataclass(frozen=True)
class WireFormat:
    """One wire format: its name (the plan's value), bits per value and the magnitude a block's
    largest value is scaled to."""

    name: str
    bits: int
    top: float

    def payload_bytes(self, numel: int) -> int:
        """Bytes of ``numel`` values of one shard (a half byte rounded up)."""
        return -(-numel * self.bits // 8)

    def shard_bytes(self, numel: int, block: int = QUANT_BLOCK) -> int:
        """Bytes one shard of ``numel`` values takes on the wire: its values and its scales."""
        return self.payload_bytes(numel) + SCALE_BYTES * blocks_of(numel, block)


WIRE_FORMATS = {
    f.name: f
    for f in (WireFormat("int8", 8, 127), WireFormat("fp8", 8, 448), WireFormat("int4", 4, 7))
}


def wire_format(name: str) -> WireFormat:
    """The format the plan calls ``name``; ValueError naming the allowed ones otherwise."""
    try:
        return WIRE_FORMATS[name]
    except KeyError:
        raise ValueError(f"wire format {name!r}: one of {', '.join(WIRE_FORMATS)}") from None


def blocks_of(numel: int, block: int = QUANT_BLOCK) -> int:
    """Blocks a shard of ``numel`` elements is quantized in."""
    return -(-numel // block)
