"""Where the running module changes, written into the graph being traced.

Capture tags every node with the module it came from and the phase it belongs to. While
make_fx traces, :class:`ModuleTracker` writes a :func:`mark_node` call into the graph wherever
the running module changes (forward: module hooks; backward: pre-hooks on the autograd nodes
of each module's outputs) and where forward ends; capture reads those marks once tracing is
done and erases them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.fx.node import has_side_effect

from zerocc.compat import get_proxy_mode

FORWARD_END = "forward_end"  # the mark's kind where forward ends ("module" elsewhere)


@has_side_effect
def mark_node(kind: str, module: str) -> None:
    """A node capture writes into the graph it traces where the running module changes
    (``kind`` "module") and where forward ends ("forward_end"); capture's ``_tag`` reads and erases
    them. A side effect, so make_fx's dead-code elimination keeps them where it drops the
    nodes around them (a count of nodes taken while tracing would then point elsewhere)."""


class ModuleTracker:
    """Marks in the traced graph which module runs from there on.

    Forward: module pre/post hooks. Backward: a pre-hook on the autograd node of each module's
    outputs, so the backward ops that follow are attributed to that module.
    """

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        self.active = True
        for fqn, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(fqn)))
            self.handles.append(module.register_forward_hook(self._leave(fqn)))

    @staticmethod
    def mark(kind: str, module: str = "") -> None:
        """Append a :func:`mark_node` node to the graph being traced (none outside tracing)."""
        mode = get_proxy_mode()
        if mode is not None:
            mode.tracer.graph.create_node("call_function", mark_node, (kind, module))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No marks and no stack changes in the body (an opaque region's forward, run inside
        its op's fake implementation, is no part of the traced graph)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def _enter(self, fqn: str):
        def hook(module, args):
            if not self.active:
                return
            self.stack.append(fqn)
            self.mark("module", fqn)

        return hook

    def _leave(self, fqn: str):
        def hook(module, args, output):
            if not self.active:
                return
            self.stack.pop()
            self.mark("module", self.stack[-1] if self.stack else "")
            # Backward tagging: when autograd reaches this module's outputs, its backward begins.
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.grad_fn.register_prehook(self._backward_of(fqn))

        return hook

    def _backward_of(self, fqn: str):
        def prehook(grad_outputs):
            if self.active:
                self.mark("module", fqn)

        return prehook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
