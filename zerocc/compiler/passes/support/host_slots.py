"""Host buffers that successive units' copies go through in turn (the offload pass's staging
and gradient buffers): two of them, each as large as the largest use, so that a copy into one
overlaps the update reading the other."""

from __future__ import annotations

import torch
from torch import fx

from zerocc.compiler.state import HOST
from zerocc.ir.nodes import emit

STAGING_SLOTS = 2  # host buffers the host updates write compute copies into, in turn


class HostSlots:
    """Host buffers (``host_buffer``, :data:`STAGING_SLOTS` of them, each as large as the
    largest use, made before the first) that successive units' copies go through in turn."""

    def __init__(self, graph: fx.Graph, name: str, numel: int, purpose: str) -> None:
        self.graph, self.name, self.numel, self.purpose = graph, name, numel, purpose
        self.buffers: list[fx.Node] = []
        self.taken = 0
        self.last_reader: dict[fx.Node, fx.Node] = {}  # buffer -> what last read it, if kept

    def take(self, dtype: torch.dtype, before: fx.Node) -> tuple[fx.Node, fx.Node | None]:
        """The next buffer in turn (made before ``before`` at the first call) and what last
        read it, if the caller recorded that."""
        if not self.buffers:
            with self.graph.inserting_before(before):
                self.buffers = [
                    emit(
                        self.graph,
                        torch.ops.zerocc.host_buffer.default,
                        (self.numel, dtype, f"{self.name}.{i}"),
                        pool=HOST,
                        phase="optimizer",
                        note=f"host buffer {i} of {STAGING_SLOTS} {self.purpose}, in turn",
                    )
                    for i in range(STAGING_SLOTS)
                ]
        buffer = self.buffers[self.taken % STAGING_SLOTS]
        self.taken += 1
        return buffer, self.last_reader.get(buffer)
