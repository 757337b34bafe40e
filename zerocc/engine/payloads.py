"""Payloads: the tensors a program's ops hand each other outside its values.

Expert parallelism's token exchange receives as many rows as the routing sends a rank, a size
no program can hold as a value (its shapes are fixed when it is traced). The exchange keeps
what it received here, under a key its op names (:mod:`zerocc.ir.ops`), and returns a ticket;
the ops that take the ticket read the rows here. A key holds a queue: a pipeline stage runs the
forwards of several micro-batches before their backwards, each putting its rows under the same
key, and the backwards take them in the same order (oldest first).
"""

from __future__ import annotations

from collections import deque

import torch


class Payloads:
    """Tensors kept under keys, queued in the order they were put."""

    def __init__(self) -> None:
        self._held: dict[str, deque[torch.Tensor]] = {}

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` under ``key``, behind what the key already holds."""
        self._held.setdefault(key, deque()).append(tensor)

    def newest(self, key: str) -> torch.Tensor:
        """The tensor put last under ``key``, kept."""
        return self._queue(key)[-1]

    def take(self, key: str) -> torch.Tensor:
        """The oldest tensor under ``key``, no longer kept."""
        queue = self._queue(key)
        tensor = queue.popleft()
        if not queue:
            del self._held[key]
        return tensor

    def check_taken(self) -> None:
        """RuntimeError unless every payload put was taken: after a program (or a pipeline
        stage's schedule) has run, its backward took every row an exchange received, or its
        experts did without a backward."""
        if self._held:
            raise RuntimeError(
                f"zerocc: a program finished with {len(self)} rows of expert parallelism's "
                f"exchanges still kept (under {', '.join(sorted(self._held))})"
            )

    def clear(self) -> None:
        """Drop everything kept (what a failed run left)."""
        self._held.clear()

    def __len__(self) -> int:
        return sum(len(q) for q in self._held.values())

    def _queue(self, key: str) -> deque[torch.Tensor]:
        queue = self._held.get(key)
        if not queue:
            raise RuntimeError(f"zerocc: no payload under {key!r}: an op reads rows never kept")
        return queue
