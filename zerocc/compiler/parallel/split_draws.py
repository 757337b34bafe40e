"""Keyed draws for tensors split over the tp ranks: each rank keeps its part of the whole
tensor's draw.

Under tensor parallelism a random op draws for the tensor its rank holds. Where that is the
whole tensor (dropout on a residual, after a rowwise layer's all-reduce) the ranks of a tp group
draw alike, under one key, and one process draws the same. Where it is a part of the tensor
(attention probabilities of the rank's heads, an MLP's hidden features, the rank's chunk of the
sequence under sequence parallelism), a draw of the part's shape gives every rank the same
numbers for different heads, features or tokens: the masks repeat across the group, and no
unsplit run draws them. Under ``capture.draws: keyed`` such an op draws the whole tensor, as
one process does for it, and keeps this rank's chunk (:func:`take_parts_of_whole_draws`): a run
with dropout inside the split layers matches the one-process reference, at the price of each
rank drawing ``tp`` times its part's numbers (and holding the whole draw until its chunk is
taken). Under ``generator`` draws nothing changes: the ranks draw their parts alike, as
Megatron does without its model-parallel generator.

Where a draw's part lies is learned by running the model's forward once more, unsplit, on fake
tensors (:func:`zerocc.compiler.capture.forward_on_fake`, no capture): its draws in order, each
with the whole tensor's shape. A part differs from its whole in one dimension, by ``tp``, and is
this rank's chunk along it: tensor parallelism splits heads, features and the sequence in rank
order. The ops taken apart so are those whose numbers follow from the shape alone (an in-place
fill such as ``bernoulli_``, a ``*_like``), and ``native_dropout`` (its mask drawn for the whole
tensor, its output computed from the chunk as the CPU kernel does). An op that draws inside a
computation on a split tensor (attention with dropout in its kernel) cannot be taken apart: a
CaptureError names it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerocc.compiler.capture import Casts, LossFn, ModelInfo, forward_on_fake
from zerocc.compiler.opaque import regions_in
from zerocc.compiler.parallel.experts import ExpertParallel
from zerocc.errors import CaptureError
from zerocc.ir.fake_values import propagate_fake_values
from zerocc.ir.keyed_draws import default_draw, draws_from, is_opaque_forward
from zerocc.ir.nodes import info, op_name, tag, val
from zerocc.ir.ops import TP_GROUP
from zerocc.ir.rng import argument

aten = torch.ops.aten

# Draws whose numbers follow from their tensor's shape (and dtype) alone: in place on ``self``.
_FILLS = {
    aten.bernoulli_.float,
    aten.uniform_.default,
    aten.normal_.default,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # (a keyword)
    aten.random_.to,
}
# ... and new tensors shaped like their first argument.
_LIKES = {
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
}


class _WholeDraws(TorchDispatchMode):
    """Records the shape of each draw's tensor in the order the forward runs them (None for an
    opaque region's call, one draw as :func:`zerocc.ir.keyed_draws.key_draws` counts it)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...] | None] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_opaque_forward(func):
            self.shapes.append(None)
        elif default_draw(func, args, kwargs):
            self.shapes.append(_drawn_shape(out))
        return out


def _drawn_shape(value: Any) -> tuple[int, ...]:
    """The shape of the tensor a draw fills: its (first) result's."""
    return tuple(next(t for t in tree_leaves(value) if isinstance(t, torch.Tensor)).shape)


def draws_outside_regions(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` holds a random op of its own (not only opaque regions' calls)."""
    return any(
        n.op == "call_function" and draws_from(n) is not None and not is_opaque_forward(n.target)
        for n in gm.graph.nodes
    )


def whole_draws(
    model: nn.Module,
    whole_info: ModelInfo,
    loss_fn: LossFn | None,
    batch: Any,
    device: torch.device,
    casts: Casts,
    gm: fx.GraphModule,
    expert_parallel: ExpertParallel | None,
) -> list[tuple[int, ...] | None]:
    """The shapes the unsplit model's forward draws, in order (None: an opaque region), run on
    fake tensors with ``whole_info``'s parameters and the opaque regions ``gm`` (the split
    capture) holds: its modules' classes, and the experts ``expert_parallel`` runs so."""
    opaque = {r.kind: r.reason for r in regions_in(gm)}
    forwards = expert_parallel.forwards(True) if expert_parallel is not None else None
    recorder = _WholeDraws()
    try:
        forward_on_fake(
            model, whole_info, loss_fn, batch, device, recorder, casts, opaque, forwards
        )
    except Exception as e:
        raise CaptureError(
            "capture.draws: keyed under tensor parallelism runs the model's forward unsplit on "
            "fake tensors, to find which draws hold a part of a split tensor; it stopped on "
            f"{type(e).__name__}: {e}. Allowed: capture.draws: generator"
        ) from e
    return recorder.shapes


def take_parts_of_whole_draws(
    gm: fx.GraphModule, whole: list[tuple[int, ...] | None], parts: int
) -> int:
    """Rewrite each draw of split step ``gm`` whose tensor is a part of ``whole``'s (the unsplit
    forward's draws, in the same order) to draw the whole tensor and keep this tp rank's chunk;
    returns how many. CaptureError where the draws do not pair up, or one cannot be taken
    apart."""
    drawn = [n for n in gm.graph.nodes if n.op == "call_function" and draws_from(n) is not None]
    if [is_opaque_forward(n.target) for n in drawn] != [shape is None for shape in whole]:
        raise CaptureError(
            f"the tensor-parallel step draws {len(drawn)} times and the unsplit forward "
            f"{len(whole)} times, or in another order: capture.draws: keyed cannot pair "
            "each split draw with its whole; allowed: capture.draws: generator"
        )
    taken = 0
    for node, shape in zip(drawn, whole, strict=True):
        if shape is None or (part := _drawn_shape(val(node))) == shape:
            continue  # a region, or a tensor every tp rank holds whole: one draw, alike
        if node.target is aten.native_dropout.default and not argument(node, "train"):
            continue  # (no draw: the input as it is)
        dim = _split_dim(node, part, shape, parts)
        with gm.graph.inserting_before(node):
            _DrawWhole(gm.graph, node, shape, dim).replace()
        taken += 1
    if taken:
        gm.graph.eliminate_dead_code()
        propagate_fake_values(gm)
    return taken


def _split_dim(node: fx.Node, part: tuple[int, ...], whole: tuple[int, ...], parts: int) -> int:
    """The one dimension where ``part`` is a ``parts``-th of ``whole``; CaptureError if none."""
    differ = [d for d, (p, w) in enumerate(zip(part, whole, strict=False)) if p != w]
    if len(part) != len(whole) or len(differ) != 1 or whole[differ[0]] != parts * part[differ[0]]:
        raise CaptureError(
            f"{_where(node)} draws for a tensor of shape {list(part)} where the unsplit model "
            f"draws {list(whole)}: not one of {parts} chunks along one dimension, so "
            "capture.draws: keyed cannot take this rank's part of the whole draw; allowed: "
            "capture.draws: generator"
        )
    return differ[0]


def _where(node: fx.Node) -> str:
    module = info(node).module
    return f"{node.name} ({op_name(node.target)}{f', in {module}' if module else ''})"


class _DrawWhole:
    """The nodes that replace one draw ``node`` of a part: the whole tensor's draw (of shape
    ``whole``), then this tp rank's chunk of it along ``dim``."""

    def __init__(self, graph: fx.Graph, node: fx.Node, whole: tuple[int, ...], dim: int) -> None:
        self.graph, self.node, self.whole, self.dim = graph, node, whole, dim
        self.part = val(node) if isinstance(val(node), torch.Tensor) else val(node)[0]

    def replace(self) -> None:
        node, target = self.node, self.node.target
        if target in _FILLS:  # fill the whole, copy the chunk into the part
            drawn = self._call(target, (self._empty(), *node.args[1:]), node.kwargs)
            out = self._call(aten.copy_.default, (node.args[0], self._chunk(drawn)))
        elif target in _LIKES:
            drawn = self._call(target, (self._empty(), *node.args[1:]), node.kwargs)
            out = self._call(aten.clone.default, (self._chunk(drawn),))
        elif target is aten.native_dropout.default:
            self._dropout()
            return
        else:
            raise CaptureError(
                f"{_where(node)} draws inside its computation on a tensor split over tp "
                f"({list(self.part.shape)} of {list(self.whole)}): capture.draws: keyed cannot "
                "take this rank's part of what one process draws; allowed: a draw that "
                "follows from the tensor's shape (dropout, bernoulli_, rand_like; for "
                "attention, dropout outside its fused kernel), or capture.draws: generator "
                "(each tp rank draws its part alike)"
            )
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _dropout(self) -> None:
        """``native_dropout(x, p)``: the mask drawn for the whole tensor, this rank's chunk of
        it, and ``x * (mask * 1/(1-p))`` in ``x``'s dtype, as the CPU kernel computes it."""
        node = self.node
        x, p = node.args[0], argument(node, "p")
        drawn = self._call(aten.native_dropout.default, (self._empty(), p, True))
        mask = self._chunk(self._call(operator.getitem, (drawn, 1)))
        scale = self._call(aten.mul.Tensor, (self._call(aten._to_copy.default, (mask,),
                                                        {"dtype": self.part.dtype}),
                                             1.0 / (1.0 - p)))  # fmt: skip
        results = (self._call(aten.mul.Tensor, (x, scale)), mask)
        for user in list(node.users):  # (the results' getitems)
            user.replace_all_uses_with(results[user.args[1]])
            self.graph.erase_node(user)
        self.graph.erase_node(node)

    def _empty(self) -> fx.Node:
        part = self.part
        return self._call(
            aten.empty.memory_format,
            (list(self.whole),),
            {"dtype": part.dtype, "device": part.device, "pin_memory": False},
        )

    def _chunk(self, whole: fx.Node) -> fx.Node:
        """This tp rank's chunk of ``whole`` along the split dimension (as
        :func:`zerocc.compiler.parallel.collectives.chunk` takes it while capturing)."""
        size = self.part.shape[self.dim]
        rank = self._call(torch.ops.zerocc.group_rank.default, (whole, TP_GROUP))
        first = self._call(aten.mul.Tensor, (rank, size))
        steps = self._call(
            aten.arange.default,
            (size,),
            {"dtype": torch.int64, "device": self.part.device, "pin_memory": False},
        )
        index = self._call(aten.add.Tensor, (first, steps))
        return self._call(aten.index_select.default, (whole, self.dim, index))

    def _call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        name = target.__name__ if target is operator.getitem else op_name(target)
        node = self.graph.create_node(
            "call_function", target, args, kwargs or {}, name=name.rpartition(".")[2]
        )
        record = info(self.node)
        return tag(node, phase=record.phase, module=record.module)
