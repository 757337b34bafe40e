"""Tensor parallelism's arithmetic in one process, for the references of low-precision parity
tests: what differs from the unsplit model is where the tp ranks' partial results are rounded.

A rowwise layer's output is the sum of the ranks' partial matmuls, each rounded to the compute
dtype and added in rank order (what the all-reduce of 16-bit tensors does); a colwise layer (or
a vocab head) computes each rank's slice of its output apart, from the rank's own view of its
input, so that backward sums each rank's input gradients, then the ranks', the same way; the
cross-entropy of the logits runs in fp32, as the vocabulary-parallel one does. Everything else
runs as written. With 2 tp ranks these are the ranks' roundings (one addition of two rounded
values, in either order).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from zerocc.compiler.names import glob_matches
from zerocc.compiler.parallel.tensor_parallel import Split


def _style(layer) -> tuple[str, int]:
    return (layer, 1) if isinstance(layer, str) else (layer["style"], layer.get("fused", 1))


class _Entries:
    """Each rank's own view of an input that colwise layers read: the layers reading one tensor
    (q, k, v) sum their input gradients per rank first, then over the ranks, as the ranks do
    (each sums its layers' contributions, the all-reduce sums the ranks')."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def of(self, x: torch.Tensor) -> list[torch.Tensor]:
        held = self._views.get(id(x))
        if held is None or held[0] is not x:
            held = self._views[id(x)] = (x, [x.view_as(x) for _ in range(self.parts)])
        return held[1]


def _sliced_output(
    module: nn.Linear, x: torch.Tensor, entries: _Entries, blocks: int
) -> torch.Tensor:
    """Each rank's slice of the output computed apart, assembled in the whole layout."""
    weights = Split(0, entries.parts, blocks)
    outs = [
        F.linear(
            mine,
            weights.take(module.weight, r),
            None if module.bias is None else weights.take(module.bias, r),
        )
        for r, mine in enumerate(entries.of(x))
    ]
    return Split(outs[0].dim() - 1, entries.parts, blocks).join(outs)


def _summed_partials(module: nn.Linear, x: torch.Tensor, parts: int) -> torch.Tensor:
    """The ranks' partial matmuls over their input features, rounded, summed in rank order."""
    inputs, weights = Split(x.dim() - 1, parts), Split(1, parts)
    out = None
    for r in range(parts):
        partial = F.linear(inputs.take(x, r), weights.take(module.weight, r))
        out = partial if out is None else out + partial
    return out if module.bias is None else out + module.bias


class _Fp32CrossEntropy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and args[0].dtype != torch.float32:
            logits = args[0]
            return func(logits.float(), *args[1:], **kwargs).to(logits.dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulated(model: nn.Module, layers: dict, parts: int) -> Iterator[None]:
    """``model`` computing as ``parts`` tp ranks split by ``layers`` (``parallel.tp_layers``)
    would, in the body."""
    patched, entries = [], _Entries(parts)
    for fqn, module in model.named_modules():
        for glob, layer in layers.items():
            if not fqn or not glob_matches(fqn, glob) or not isinstance(module, nn.Linear):
                continue
            style, blocks = _style(layer)
            if style == "rowwise":
                module.forward = types.MethodType(
                    lambda m, x: _summed_partials(m, x, parts), module
                )
            else:  # colwise, or a vocab head
                module.forward = types.MethodType(
                    lambda m, x, b=blocks: _sliced_output(m, x, entries, b), module
                )
            patched.append(module)
    try:
        with _Fp32CrossEntropy():
            yield
    finally:
        for module in patched:
            del module.forward
