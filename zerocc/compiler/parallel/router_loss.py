"""A router's load-balancing loss in a captured step: a statistic of the tokens a program runs
on, which micro-batches change.

A mixture of experts' load-balancing loss (Switch Transformer's, which transformers' Mixtral,
Qwen2-MoE and their kin add when ``output_router_logits`` is set) multiplies two statistics of
the tokens: each expert's share of the top-k picks and its mean routing probability. A product
of two means is no mean of the tokens' own terms: computed over each of a batch's micro-batches
and averaged, it is not what the whole batch gives. zerocc runs the step's program once per
micro-batch (``grad_accumulation``; a pipeline's ``pipeline.microbatches``) and on each data
rank's own batch, so the loss holds each micro-batch's statistic, as DeepSpeed and Megatron
compute it (their ``aux_loss`` per micro-batch): :func:`router_loss_lines` says so.

The loss is found in the program's forward as its routers compute it: a softmax over a
``[tokens, experts]`` tensor that a ``topk`` reads (the picks) and whose sum or mean over the
tokens (dim 0) the program keeps, directly or through elementwise ops (a padding mask). The
router's own softmax feeds its top-k alone: each token's weights, no statistic of the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

aten = torch.ops.aten
_SOFTMAX = (aten._softmax.default, aten.softmax.int)
_TOPK = aten.topk.default
_OVER_TOKENS = (aten.sum.dim_IntList, aten.mean.dim)
# Ops between the probabilities and their sum that keep each token's row its own
_ROWWISE = (aten._to_copy.default, aten.mul.Tensor, aten.view.default, aten.clone.default)


def router_statistics(gm: fx.GraphModule) -> int:
    """How many softmaxes of ``gm`` are a router's probabilities whose statistic over the tokens
    the step keeps: picked by a ``topk`` and summed (or averaged) over dim 0."""
    found = 0
    for node in gm.graph.nodes:
        if node.target not in _SOFTMAX or _rank(node) != 2:
            continue
        users = _through_rowwise(node)
        picked = any(u.target is _TOPK for u in users)
        if picked and any(_over_tokens(u) for u in users):
            found += 1
    return found


def _rank(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else None


def _through_rowwise(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``, directly or through ops that keep its rows apart."""
    seen, todo, out = {node}, list(node.users), []
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        out.append(user)
        if user.target in _ROWWISE and _rank(user) == 2:
            todo.extend(user.users)
    return out


def _over_tokens(node: fx.Node) -> bool:
    """Whether ``node`` sums or averages a ``[tokens, experts]`` tensor over its tokens."""
    if node.target not in _OVER_TOKENS or len(node.args) < 2:
        return False
    dims = node.args[1]
    return isinstance(dims, (list, tuple)) and [d % 2 for d in dims] == [0]


def router_loss_lines(
    programs: Iterable[fx.GraphModule], micro_batches: int, data_ranks: int, *, pipeline: bool
) -> list[str]:
    """A line on the routers' load-balancing loss the ``programs`` of one micro-batch hold
    (a step's program, or a pipeline's stages' forwards; none where they hold none): each
    computes it over its own tokens, a micro-batch of a data rank's batch (``micro_batches``:
    ``grad_accumulation``, or the pipeline's micro-batches where ``pipeline``), not over the
    whole batch."""
    routers = sum(router_statistics(gm) for gm in programs)
    if not routers:
        return []
    where = []
    if micro_batches > 1:
        knob = "pipeline.microbatches" if pipeline else "grad_accumulation"
        where.append(f"per micro-batch ({micro_batches}: {knob})")
    if data_ranks > 1:
        where.append(f"on each of the {data_ranks} data ranks' batches")
    if not where:
        return [
            f"router load-balancing loss ({routers} router{'s' * (routers != 1)}): a "
            "statistic of the tokens, computed over the whole batch (one micro-batch, one "
            "data rank)"
        ]
    return [
        f"router load-balancing loss ({routers} router{'s' * (routers != 1)}): a statistic of "
        f"the tokens, computed {' and '.join(where)} and the losses averaged, as DeepSpeed and "
        "Megatron compute it; not the statistic of the whole batch, which one process "
        "training on it would compute (docs/parallelism.md)"
    ]
