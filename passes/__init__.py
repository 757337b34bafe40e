"""zerocc's built-in passes; importing this package registers them with the pass manager."""

from zerocc.passes import optimizer, partition, shard

__all__ = ["optimizer", "partition", "shard"]
