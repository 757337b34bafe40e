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
from zerocc.errors import CaptureError, PlanError


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


def gradient_summed(x: torch.Tensor) -> torch.Tensor:
    """``x`` as it is, its gradient summed over the tp ranks (each computed it from its own
    tokens); ``x`` itself when it needs no gradient."""
    return _SumGradient.apply(x) if x.requires_grad else x


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
        # What was computed from a chunk and holds a value of this rank's tokens alone (not
        # gathered back into the whole sequence): chunks, and what ops made of them
        self._local: dict[int, torch.Tensor] = {}
        self._not_params: dict[int, torch.Tensor] = {}  # leaves that stand for computed values

    def _length(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor) or t.dim() < -self.dim:
            return None
        return t.shape[self.dim]

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        self._chunks[id(t)] = t
        self._local[id(t)] = t
        return t

    def _is_local(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._local.get(id(t)) is t

    def check_loss(self, loss: torch.Tensor) -> None:
        """Refuse a loss computed in part from this rank's tokens alone: with every op on the
        tokens alike it would equal the other tp ranks' (the vocab head gathers the sequence),
        but a statistic over the tokens outside the split layers (a mixture of experts'
        load-balancing loss: each expert's share of the tokens) is this chunk's, not the
        sequence's, and each tp rank would train on its own."""
        if self._is_local(loss):
            raise PlanError(
                "parallel.sequence_parallel: the model's loss depends on a value computed over "
                "the tokens of each tp rank's chunk of the sequence outside the split layers "
                "(such as a mixture-of-experts router's load-balancing loss), which would differ "
                "between the tp ranks and not be the whole sequence's: set "
                "parallel.sequence_parallel: false for this model"
            )

    def is_chunk(self, t: Any) -> bool:
        """Whether ``t`` is a tensor of this rank's chunk of the sequence."""
        return isinstance(t, torch.Tensor) and self._chunks.get(id(t)) is t

    def _is_param(self, t: torch.Tensor) -> bool:
        if self._not_params.get(id(t)) is t:
            return False
        return (t.is_leaf and t.requires_grad) or self._params.get(id(t)) is t

    def status_of(self, t: torch.Tensor) -> tuple[bool, bool, bool]:
        """What this split knows of ``t``: whether it is a chunk, holds a value of this rank's
        tokens, is a parameter (a repeated layer's template is traced on fresh tensors given
        its call's, and its copies' outputs are given its outputs';
        :class:`zerocc.compiler.repeats.TensorStatus`)."""
        return self.is_chunk(t), self._is_local(t), self._is_param(t)

    def set_status(self, t: torch.Tensor, status: tuple[bool, bool, bool]) -> None:
        """Make ``t`` what :meth:`status_of` said of another tensor."""
        chunk, local, param = status
        if chunk:
            self._chunks[id(t)] = t
        if local:
            self._local[id(t)] = t
        if param:
            self._params[id(t)] = t
        else:
            self._not_params[id(t)] = t

    def gather(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        """The whole sequence of chunks ``x``, entering ``layer``: every rank's tokens, no
        value of one rank's alone (whatever the ops inside the gather were marked)."""
        whole = _Gather.apply(x, self.dim, self.parts, layer)
        self._local.pop(id(whole), None)
        return whole

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

    def operands(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """An op's operands where one holds values of this rank's tokens (a chunk of the
        sequence, or what ops made of one: a flattened chunk, its rows sorted or repeated by
        a mixture of experts): whole sequences meeting a chunk cut to this rank's chunk, and
        tensors that need a gradient and do not hold this rank's tokens (parameters) have it
        summed over the ranks (see the module's docstring). Lists of tensors count (an opaque
        region's operands); the tensor an in-place op writes is left as it is."""
        tensors = [t for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)]
        if len(tensors) < 2 or not any(self._is_local(t) for t in tensors):
            return args, kwargs
        chunked = any(self.is_chunk(t) for t in tensors)

        def fit(a: Any) -> Any:
            if isinstance(a, list | tuple) and not isinstance(a, torch.Size):
                return type(a)(fit(x) for x in a)
            if not isinstance(a, torch.Tensor) or self._is_local(a):
                return a
            if chunked and self._length(a) == self.whole and not self._is_param(a):
                return self._mark(_Cut.apply(a, self.dim, self.parts))
            return _SumGradient.apply(a) if a.requires_grad else a

        written = args[:1] if _in_place(func) else ()
        fitted = tuple(fit(a) for a in args[len(written) :])
        return (*written, *fitted), {k: fit(v) for k, v in kwargs.items()}

    def follow(self, args: tuple, kwargs: dict, out: Any) -> None:
        """After an op: what it made of a chunk, with the chunk's length, is a chunk; what it
        made of a chunk or of such a value, but the whole sequence, holds a value of this
        rank's tokens alone; a cast of a parameter is a parameter."""
        inputs = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        outputs = [out] if isinstance(out, torch.Tensor) else []
        if isinstance(out, tuple | list):
            outputs = [o for o in out if isinstance(o, torch.Tensor)]
        if any(self._is_local(t) for t in inputs):
            chunked = self.whole is not None and any(self.is_chunk(t) for t in inputs)
            for o in outputs:
                self._local[id(o)] = o
                if chunked and self._length(o) == self.whole // self.parts:
                    self._mark(o)
        elif len(inputs) == 1 and self._is_param(inputs[0]) and len(outputs) == 1:
            if outputs[0].shape == inputs[0].shape:  # (a cast to the compute dtype)
                self._params[id(outputs[0])] = outputs[0]


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    """An op's arguments, the elements of a list or tuple argument in its place."""
    return [
        x
        for a in (*args, *kwargs.values())
        for x in (a if isinstance(a, list | tuple) and not isinstance(a, torch.Size) else [a])
    ]


_IN_PLACE_OPERATORS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__", "__imod__"}
)


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes its first operand (``x.add_(y)``, ``x += y``)."""
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
