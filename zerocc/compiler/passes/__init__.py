"""zerocc's built-in passes; importing this package registers them with the pass manager.

A module here is one of two kinds:

- **a registered pass** (``register_pass``; the pass manager orders and runs it): ``partition``,
  ``recompute``, ``shard``, ``precision``, ``optimizer``, ``offload``, ``overlap``;
- **what a pass is**: ``spec`` (``PassSpec``, ``PassContext``, ``register_pass``).

The helpers those passes call (analyses and emitters that register nothing) are in
:mod:`zerocc.compiler.passes.support`.
"""

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
