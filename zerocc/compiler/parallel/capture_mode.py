"""What tensor-parallel layers run while the step is captured: their forwards, the collectives
autograd sees in them, and the vocabulary-parallel cross-entropy.

The forwards replace a split module's own for the capture (see
:mod:`zerocc.compiler.parallel.tensor_parallel`); the collectives are zerocc's start/wait ops on the
``tp`` group, issued from autograd Functions so that capture records them in forward and in
backward. One :class:`Region` per capture holds what the layers share.

**The loss over a split vocabulary.** A ``vocab`` output head gives its callers the whole logits
(every rank's slice, gathered): whatever the model computes from them runs as written. While
the step is captured, :class:`CaptureMode` follows those logits through reshapes and
casts that keep the vocabulary as the last dimension (``logits.view(B * T, -1)``,
``logits.float()``), and a ``F.cross_entropy`` of them runs on each rank's slice instead
(Megatron's vocabulary-parallel cross-entropy): the row maxima gathered, the sums of
exponentials and the target's logit all-reduced, a few numbers per token where the gather moved
``B × T × V``. The gather, now unused, is dropped with the other dead code, so no rank holds the
whole logits. A cross-entropy it cannot take (class weights, label smoothing, targets given as
probabilities) reads the gathered logits as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from zerocc.compiler.parallel.collectives import TP, all_gather, all_reduce, chunk
from zerocc.compiler.parallel.sequence import SequenceSplit
from zerocc.compiler.repeats import LAYER_OPS
from zerocc.ir.ops import op


class _EnterRegion(torch.autograd.Function):
    """Forward: the input as it is (every tp rank holds it); backward: the gradient summed over
    the tp ranks (each computed the part its slice of the weights gives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: str) -> torch.Tensor:
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, f"all-reduce the input gradient of {ctx.layer} (tp)"), None


class _LeaveRegion(torch.autograd.Function):
    """Forward: the partial results summed over the tp ranks; backward: the gradient as it is
    (every rank computes what follows alike, so each one's gradient is the whole one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, why: str) -> torch.Tensor:
        return all_reduce(x, why)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    """Forward: every tp rank's slice, concatenated along ``dim`` in rank order; backward: this
    rank's slice of the gradient (every rank computed the whole gradient alike)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, parts: int, why: str) -> torch.Tensor:
        ctx.dim, ctx.size = dim % x.dim(), x.shape[dim]
        return all_gather(x, dim, parts, why)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return chunk(grad, ctx.dim, ctx.size), None, None, None


class Region:
    """What the split layers of one capture share: the inputs that entered the
    tensor-parallel region (the layers that read the same tensor, q, k and v or an MLP's gate
    and up projections, share one entry, so backward all-reduces their summed input gradient
    once) and the whole logits of vocab heads, by the slice each rank holds."""

    def __init__(self, parts: int, sequence: SequenceSplit | None = None) -> None:
        self.parts = parts
        self.sequence = sequence  # sequence parallelism's split, when the plan asks for it
        self._entered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[int, torch.Tensor] = {}  # sequences gathered at a module's input
        # id(whole logits, or a reshape of them) -> (them, this rank's slice alike reshaped)
        self.logits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def enter(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        """``x`` as the tp ranks read it in ``layer`` (its style and name), the first of the
        layers reading it."""
        if self._gathered.get(id(x)) is x:  # its gradient is reduce-scattered already
            return x
        held = self._entered.get(id(x))  # (x is held too: its id is not reused meanwhile)
        if held is None:
            if self.sequence is not None and self.sequence.is_chunk(x):
                entered = self.sequence.gather(x, layer)
            else:
                entered = _EnterRegion.apply(x, layer)
            held = self._entered[id(x)] = (x, entered)
        return held[1]

    def gather_inputs(self, module: str) -> _GatherInputs:
        """A forward pre-hook (with kwargs) for the module holding colwise layers: the chunks
        it is given become the whole sequence (the module reads its length, as attention's
        head views do), and its colwise layers read that as it is."""
        return _GatherInputs(self, module)

    def gathered(self, x: torch.Tensor, module: str) -> torch.Tensor:
        """``x`` as :meth:`gather_inputs`' hook passes it to ``module``."""
        if self.sequence is None or not self.sequence.is_chunk(x):
            return x
        whole = self.sequence.gather(x, f"{module or 'the model'}'s input")
        self._gathered[id(whole)] = whole
        return whole

    def slice_of(self, logits: Any) -> torch.Tensor | None:
        """This rank's slice of ``logits`` when they are a vocab head's whole logits."""
        held = self.logits.get(id(logits)) if isinstance(logits, torch.Tensor) else None
        return held[1] if held is not None and held[0] is logits else None


class _GatherInputs:
    """:meth:`Region.gather_inputs`' hook. It does for every module what it does for one, its
    name in the notes apart: a repeated layer's copies may stand for its calls (its
    :meth:`repeat_key`, :class:`zerocc.compiler.twins.RepeatKeyed`)."""

    def __init__(self, region: Region, module: str) -> None:
        self.region, self.module = region, module

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        region, name = self.region, self.module
        return (
            tuple(region.gathered(a, name) for a in args),
            {k: region.gathered(v, name) for k, v in kwargs.items()},
        )

    def repeat_key(self) -> str:
        return "gather inputs"


# -- the tensor-parallel forwards ----------------------------------------------------------------


# Each takes the module, its input, the capture's region and the layer's name (its style and
# FQN, for the notes of its collectives).


def colwise(self: nn.Linear, x: torch.Tensor, region: Region, layer: str) -> torch.Tensor:
    return F.linear(region.enter(x, layer), self.weight, self.bias)


def rowwise(self: nn.Linear, x: torch.Tensor, region: Region, layer: str) -> torch.Tensor:
    partial = F.linear(x, self.weight)
    if region.sequence is not None:
        out = region.sequence.scatter(partial, layer)
    else:
        out = _LeaveRegion.apply(partial, f"all-reduce the partial outputs of {layer} (tp)")
    return out if self.bias is None else out + self.bias  # (the bias once, after the sum)


def vocab_head(self: nn.Linear, x: torch.Tensor, region: Region, layer: str) -> torch.Tensor:
    mine = F.linear(region.enter(x, layer), self.weight, self.bias)
    why = f"all-gather the logits of {layer} over the vocabulary (tp)"
    logits = _Gather.apply(mine, -1, region.parts, why)
    region.logits[id(logits)] = (logits, mine)
    return logits


def vocab_embedding(
    self: nn.Embedding, ids: torch.Tensor, region: Region, layer: str
) -> torch.Tensor:
    held = self.weight.shape[0]  # this rank's tokens: [rank × held, (rank + 1) × held)
    local = ids - op("group_rank")(ids, TP) * held
    outside = (local < 0) | (local >= held)
    looked = F.embedding(local.masked_fill(outside, 0), self.weight)
    if self.padding_idx is not None:  # the padding token's row gets no gradient
        looked = torch.where((ids == self.padding_idx).unsqueeze(-1), looked.detach(), looked)
    why = f"all-reduce the lookups of {layer} (tp)"
    return _LeaveRegion.apply(looked.masked_fill(outside.unsqueeze(-1), 0.0), why)


FORWARDS: dict[tuple[str, str], Callable[..., torch.Tensor]] = {
    ("linear", "colwise"): colwise,
    ("linear", "rowwise"): rowwise,
    ("linear", "vocab"): vocab_head,
    ("embedding", "vocab"): vocab_embedding,
}


# -- the loss over a split vocabulary ------------------------------------------------------------

# What keeps logits logits: reshapes of the leading dimensions and dtype casts.
_KEEPS_LOGITS = {
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.contiguous, torch.Tensor.float, torch.Tensor.to,
}  # fmt: skip


# What the mode lets pass as it is: a repeated layer's calls (its template's ops were fitted as
# they were traced) and the call of autograd (its gradients follow from what was fitted; the
# outputs a layer's template differentiates are chunks, and its inputs are no parameters
# to sum the gradients of)
_PASSED = frozenset({*LAYER_OPS, torch.autograd.grad})


class CaptureMode(TorchFunctionMode):
    """Active while the step is captured: a cross-entropy of a vocab head's whole logits runs
    on each rank's slice of them (see the module's docstring), and under sequence parallelism
    every op's operands are fitted to the chunks (:meth:`SequenceSplit.operands`)."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PASSED:
            return func(*args, **kwargs)
        if self.region.sequence is not None:
            args, kwargs = self.region.sequence.operands(func, args, kwargs)
        mine = self.region.slice_of(args[0]) if args else None
        if mine is not None and func is F.cross_entropy:
            taken = _cross_entropy_args(*args[1:], **kwargs)
            if taken is not None:
                return vocab_parallel_cross_entropy(mine, *taken, self.region.parts)
        out = func(*args, **kwargs)
        if self.region.sequence is not None:
            self.region.sequence.follow(args, kwargs, out)
        if mine is not None and func in _KEEPS_LOGITS and _same_rows(args[0], out):
            shape = (*out.shape[:-1], mine.shape[-1])
            self.region.logits[id(out)] = (out, mine.reshape(shape).to(out.dtype))
        return out


def _same_rows(logits: torch.Tensor, out: Any) -> bool:
    return (
        isinstance(out, torch.Tensor)
        and out.dim() >= 1
        and out.shape[-1] == logits.shape[-1]
        and out.numel() == logits.numel()
    )


def _cross_entropy_args(
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, int, str] | None:
    """(target, ignore_index, reduction) of a cross-entropy the vocabulary-parallel one
    computes alike; None for one it does not (it then reads the whole logits)."""
    plain = weight is None and size_average is None and reduce is None and not label_smoothing
    if not plain or target.is_floating_point() or reduction not in ("mean", "sum", "none"):
        return None
    return target, ignore_index, reduction


def vocab_parallel_cross_entropy(
    mine: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, parts: int
) -> torch.Tensor:
    """``F.cross_entropy`` of the whole logits, from this rank's slice ``mine`` (``[N, V/tp]``
    or ``[V/tp]``, the classes last) of ``parts``: the log-sum-exp and the target's logit are
    summed over the tp ranks."""
    shape, dtype = target.shape, mine.dtype
    rows = mine.reshape(-1, mine.shape[-1]).float()  # (fp32 sums, as torch's kernel keeps them)
    target = target.reshape(-1)
    why = "of the vocabulary-parallel cross-entropy (tp)"
    row_max = rows.detach().amax(-1, keepdim=True)
    maxima = all_gather(row_max, -1, parts, f"all-gather the row maxima {why}")
    top = maxima.amax(-1, keepdim=True)  # the row maxima over the whole vocabulary
    shifted = rows - top
    sum_exp = _LeaveRegion.apply(shifted.exp().sum(-1), f"all-reduce the sums of exp {why}")
    held = rows.shape[-1]
    local = target - op("group_rank")(target, TP) * held
    here = (local >= 0) & (local < held)
    picked = shifted.gather(-1, local.clamp(0, held - 1).unsqueeze(-1)).squeeze(-1)
    mine_picked = picked.masked_fill(~here, 0.0)
    target_logit = _LeaveRegion.apply(mine_picked, f"all-reduce the target logits {why}")
    loss = sum_exp.log() - target_logit
    counted = target != ignore_index
    loss = loss.masked_fill(~counted, 0.0)
    if reduction == "none":
        return loss.reshape(shape).to(dtype)
    total = loss.sum()
    return (total if reduction == "sum" else total / counted.sum()).to(dtype)
