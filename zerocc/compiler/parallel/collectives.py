"""The tensor-parallel collectives a captured step holds, as the capture-time code issues
them: zerocc's start/wait ops on the ``tp`` group, each with a note saying why it is there
(kept in its node's custom meta under :data:`NOTE`, read by
:func:`zerocc.compiler.parallel.tensor_parallel.tag_collectives`)."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback

from zerocc.ir.ops import TP_GROUP, op

TP = TP_GROUP
NOTE = "zerocc_note"  # the key of a collective's note in its node's custom meta


def all_reduce(x: torch.Tensor, why: str) -> torch.Tensor:
    """The sum of ``x`` over the tp ranks (a new tensor)."""
    out = x.clone(memory_format=torch.contiguous_format)
    with fx_traceback.annotate({NOTE: why}):
        return op("wait")(op("all_reduce_start")(out, TP))


def all_gather(x: torch.Tensor, dim: int, parts: int, why: str) -> torch.Tensor:
    """Every tp rank's ``x``, concatenated along ``dim`` in rank order."""
    dim %= x.dim()
    with fx_traceback.annotate({NOTE: why}):
        flat = op("wait")(op("all_gather_start")(x.contiguous().view(-1), parts, TP))
    return flat.view(parts, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(x: torch.Tensor, dim: int, parts: int, why: str) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum of every tp rank's ``x``."""
    dim %= x.dim()
    rows = x.movedim(dim, 0).contiguous()
    with fx_traceback.annotate({NOTE: why}):
        flat = op("wait")(op("reduce_scatter_start")(rows.view(-1), parts, TP))
    return flat.view(rows.shape[0] // parts, *rows.shape[1:]).movedim(0, dim)


def chunk(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """This tp rank's chunk of ``size`` along ``dim`` (no communication)."""
    first = op("group_rank")(x, TP) * size
    return x.index_select(dim, first + torch.arange(size, device=x.device))
