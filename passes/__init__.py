"""zerocc's built-in passes; importing this package registers them with the pass manager."""

from zerocc.passes import optimizer, partition, precision, shard

__all__ = ["optimizer", "partition", "precision", "shard"]
