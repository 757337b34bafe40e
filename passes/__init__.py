"""zerocc's built-in passes; importing this package registers them with the pass manager."""

from zerocc.passes import optimizer, overlap, partition, precision, shard

__all__ = ["optimizer", "overlap", "partition", "precision", "shard"]
