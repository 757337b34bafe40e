"""zerocc's built-in passes; importing this package registers them with the pass manager."""

from zerocc.compiler.passes import (
    offload,
    optimizer,
    overlap,
    partition,
    precision,
    recompute,
    shard,
)

__all__ = ["offload", "optimizer", "overlap", "partition", "precision", "recompute", "shard"]
