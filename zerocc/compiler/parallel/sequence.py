"""Sequence parallelism (``parallel.sequence_parallel``): between the tensor-parallel layers,
each tp rank holds its chunk of the sequence, not all of it (Megatron's SP).

Without it, every tp rank computes the norms, dropout and residual adds between the split
layers on the whole sequence, alike. With it, a rowwise layer's partial outputs are
reduce-scattered along the sequence instead of all-reduced (each rank keeps the sum for its
chunk of the tokens), and a colwise layer all-gathers the sequence back before its matmul
(reduce-scattering the input gradient in backward): the same bytes as the all-reduce, in two
halves, and the activations between the layers are ``1 / tp`` of their size.

What runs between the layers is the model's own code, traced as written, and sees the
chunks; :meth:`SequenceSplit.operands` (called for every op while the step is captured) keeps it
right where a chunk meets a tensor that holds every token or none:

- a tensor of the whole sequence (the embedding's output entering the first residual add) is
  cut to this rank's chunk (its gradient all-gathered in backward);
- a tensor without the sequence that needs a gradient (a norm's weight, a rowwise layer's
  bias) is used as it is, and its gradient, which covers this rank's tokens only, is summed
  over the tp ranks.

The sequence is ``sequence_dim`` (counted from the end: ``-2`` for ``[batch, sequence,
hidden]``); its whole length is what a rowwise layer's output had before its reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch

from zerocc.compiler.parallel.collectives import all_gather, all_reduce, chunk, reduce_scatter
from zerocc.errors import CaptureError


class _Gather(torch.autograd.Function):
    """Forward: every rank's chunk, the whole sequence; backward: the gradient's sum over the
    ranks, this rank's chunk of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, parts: int, layer: str) -> torch.Tensor:
        ctx.dim, ctx.parts, ctx.layer = dim, parts, layer
        return all_gather(x, dim, parts, f"all-gather the sequence into {layer} (tp)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        why = f"reduce-scatter the input gradient of {ctx.layer} along the sequence (tp)"
        return reduce_scatter(grad, ctx.dim, ctx.parts, why), None, None, None


class _Scatter(torch.autograd.Function):
    """Forward: the partial results' sum over the ranks, this rank's chunk of the sequence;
    backward: every rank's chunk of the gradient, the whole sequence."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, parts: int, layer: str) -> torch.Tensor:
        ctx.dim, ctx.parts, ctx.layer = dim, parts, layer
        why = f"reduce-scatter the partial outputs of {layer} along the sequence (tp)"
        return reduce_scatter(x, dim, parts, why)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        why = f"all-gather the output gradient of {ctx.layer} along the sequence (tp)"
        return all_gather(grad, ctx.dim, ctx.parts, why), None, None, None


class _Cut(torch.autograd.Function):
    """Forward: this rank's chunk of a whole sequence every rank holds alike; backward: every
    rank's chunk of the gradient, the whole one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
        ctx.dim, ctx.parts = dim, parts
        return chunk(x, dim, x.shape[dim] // parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        why = "all-gather the gradient of a whole sequence cut into chunks (tp)"
        return all_gather(grad, ctx.dim, ctx.parts, why), None, None


class _SumGradient(torch.autograd.Function):
    """Forward: the tensor as it is; backward: its gradient summed over the tp ranks (each
    computed it from its own tokens)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        why = "all-reduce the gradient of a tensor used on every rank's tokens (tp)"
        return all_reduce(grad, why)


class SequenceSplit:
    """The sequence's split during one capture: ``dim`` (from the end), over ``parts`` ranks.

    Which tensors are chunks is tracked, not guessed from shapes (a weight can have the
    chunk's length at ``dim``): the reduce-scatters' and cuts' results, and what an op makes
    of a chunk with the chunk's length. Parameters (leaves that need a gradient, and their
    casts) are never cut."""

    def __init__(self, dim: int, parts: int) -> None:
        self.dim, self.parts = dim, parts
        self.whole: int | None = None  # the sequence's length, once a rowwise layer saw it
        self._chunks: dict[int, torch.Tensor] = {}  # held: their ids are not reused meanwhile
        self._params: dict[int, torch.Tensor] = {}

    def _length(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor) or t.dim() < -self.dim:
            return None
        return t.shape[self.dim]

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        self._chunks[id(t)] = t
        return t

    def is_chunk(self, t: Any) -> bool:
        """Whether ``t`` is a tensor of this rank's chunk of the sequence."""
        return isinstance(t, torch.Tensor) and self._chunks.get(id(t)) is t

    def _is_param(self, t: torch.Tensor) -> bool:
        return (t.is_leaf and t.requires_grad) or self._params.get(id(t)) is t

    def gather(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        """The whole sequence of chunks ``x``, entering ``layer``."""
        return _Gather.apply(x, self.dim, self.parts, layer)

    def scatter(self, partial: torch.Tensor, layer: str) -> torch.Tensor:
        """This rank's chunk of the sum of ``layer``'s partial outputs."""
        length = self._length(partial)
        if length is None or length % self.parts:
            raise CaptureError(
                f"sequence parallelism splits dimension {self.dim} of {layer}'s output "
                f"(shape {tuple(partial.shape)}) over {self.parts} tp ranks: it must be a "
                "sequence whose length they divide; set parallel.sequence_dim, or a length "
                f"that is a multiple of {self.parts}"
            )
        if self.whole not in (None, length):
            raise CaptureError(
                f"sequence parallelism: {layer}'s output holds {length} tokens, an earlier "
                f"layer's {self.whole}; every rowwise layer must see the one sequence"
            )
        self.whole = length
        return self._mark(_Scatter.apply(partial, self.dim, self.parts, layer))

    def operands(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """An op's operands where one is a chunk of the sequence: whole sequences cut to this
        rank's chunk, tensors without the sequence that need a gradient have it summed over
        the ranks (see the module's docstring)."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if len(tensors) < 2 or not any(self.is_chunk(t) for t in tensors):
            return args, kwargs

        def fit(a: Any) -> Any:
            if not isinstance(a, torch.Tensor) or self.is_chunk(a):
                return a
            if self._length(a) == self.whole and not self._is_param(a):
                return self._mark(_Cut.apply(a, self.dim, self.parts))
            return _SumGradient.apply(a) if a.requires_grad else a

        return tuple(fit(a) for a in args), {k: fit(v) for k, v in kwargs.items()}

    def follow(self, args: tuple, kwargs: dict, out: Any) -> None:
        """After an op: what it made of a chunk, with the chunk's length, is a chunk; a cast of
        a parameter is a parameter."""
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        outputs = [out] if isinstance(out, torch.Tensor) else []
        if isinstance(out, tuple | list):
            outputs = [o for o in out if isinstance(o, torch.Tensor)]
        if any(self.is_chunk(t) for t in inputs):
            for o in outputs:
                if self.whole is not None and self._length(o) == self.whole // self.parts:
                    self._mark(o)
        elif len(inputs) == 1 and self._is_param(inputs[0]) and len(outputs) == 1:
            if outputs[0].shape == inputs[0].shape:  # (a cast to the compute dtype)
                self._params[id(outputs[0])] = outputs[0]
