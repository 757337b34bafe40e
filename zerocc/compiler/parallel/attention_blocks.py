"""The block math of context-parallel attention, as plain torch functions (issue 79).

One rank's query chunk attends to one K/V chunk at a time; each block gives its output
normalised over that block alone and the block's log-sum-exp, and `merge_partials` folds the
blocks together by their log-sum-exps, so that the merged result is softmax attention over every
key the rank has seen. The backward of a block needs only the merged output and log-sum-exp
(FlashAttention's recomputation): it gives this block's dQ, dK and dV.

Everything is computed in fp32 whatever the inputs' dtype, and uses only ops every backend runs
(eager, Inductor, CPU). Shapes are (batch, heads, tokens, head_dim); a log-sum-exp is
(batch, heads, tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked_scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """The block's scaled scores in fp32, -inf where ``mask`` (broadcast to (B, H, Tq, Tk),
    True = attend) is False."""
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _probabilities(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse), 0 on a row that attends to nothing (its lse is -inf)."""
    finite = torch.isfinite(lse)
    shifted = scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1)
    probs = torch.exp(shifted)
    return torch.where(finite.unsqueeze(-1), probs, torch.zeros_like(probs))


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one K/V block: (output normalised over this block, the block's
    log-sum-exp), both fp32. A row that attends to no key of the block has output 0 and
    log-sum-exp -inf, which `merge_partials` weighs as nothing."""
    scores = _masked_scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(_probabilities(scores, lse), v.float())
    return out, lse


def merge_partials(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Two partial attention results over disjoint key sets merged into the result over their
    union: each output weighed by exp(its lse - the union's lse). Rows where both are empty
    (-inf) stay 0 with lse -inf."""
    top = torch.maximum(lse, block_lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight_a = torch.exp(lse - top)
    weight_b = torch.exp(block_lse - top)
    total = weight_a + weight_b
    merged_lse = top + torch.log(total)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    merged = (out * weight_a.unsqueeze(-1) + block_out * weight_b.unsqueeze(-1)) / (
        safe_total.unsqueeze(-1)
    )
    return merged, merged_lse


def output_dot(out: Tensor, dout: Tensor) -> Tensor:
    """rowsum(dO * O) in fp32, the term every block's backward subtracts (softmax's Jacobian
    over the whole row, computed once from the merged output)."""
    return (dout.float() * out.float()).sum(dim=-1)


def block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of the gradients, fp32: (dQ from these keys, dK, dV of these keys).
    ``lse`` is the merged log-sum-exp over every key the rows attend to and ``delta``
    `output_dot` of the merged output, so the block's probabilities are the final ones."""
    probs = _probabilities(_masked_scores(q, k, scale, mask), lse)
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-2, -1), dout32)
    dprobs = torch.matmul(dout32, v.float().transpose(-2, -1))
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(dscores, k.float())
    dk = torch.matmul(dscores.transpose(-2, -1), q.float())
    return dq, dk, dv
