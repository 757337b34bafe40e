"""The whole model on every rank of a pipeline: each pipeline rank holds its stages' parameters
(and every buffer), and ``full_state_dict()`` means on it what it means on any other step, the
whole model's state dict on every rank (issue 78).

Each rank first gathers the full tensors its stages hold over its stage's data-parallel (and
tensor- or expert-parallel) ranks, as any step does (:meth:`StateStore.full_state_dict`); the
ranks of a pipeline then hand each other their parts over the ``pp`` group: which tensors (their
shapes and dtypes, one object gathered over every rank), then the values, one broadcast per
pipeline rank and dtype. A tensor that more than one pipeline rank holds (a tied embedding and
head, the buffers) is the first one's: they are equal, the update of a tied parameter sums its
stages' gradients before either applies it.
"""

from __future__ import annotations

import torch

from zerocc.engine.comm import Comm
from zerocc.ir.ops import PP_GROUP
from zerocc.runtime.agreement import has_peers

# A tensor's place in a part handed over: its key, shape and dtype.
Entry = tuple[str, tuple[int, ...], torch.dtype]


def whole_model(
    comm: Comm,
    device: torch.device,
    pipeline_ranks: list[int],
    mine: dict[str, torch.Tensor],
    order: list[str],
) -> dict[str, torch.Tensor]:
    """``{fqn: full tensor on CPU}`` of the whole model, in ``order`` (the model's own
    ``state_dict()`` keys), from ``mine`` (what this rank's stages hold, full) and what the
    other ranks of its pipeline (``pipeline_ranks``, global ranks by pipeline rank) hold. A
    collective: every rank calls it together. Without peers (a FakeComm's simulated ranks)
    ``mine`` alone."""
    if not has_peers(comm):
        return {k: mine[k] for k in order if k in mine}
    held = [(k, tuple(v.shape), v.dtype) for k, v in mine.items()]
    everyone: list[list[Entry]] = comm.all_gather_object(held)
    group = comm.on(PP_GROUP)
    full: dict[str, torch.Tensor] = {}
    for source in pipeline_ranks:
        entries = [e for e in everyone[source] if e[0] not in full]
        for dtype in sorted({e[2] for e in entries}, key=str):
            part = [e for e in entries if e[2] == dtype]
            if source == comm.rank:
                flat = torch.cat([mine[k].reshape(-1) for k, _, _ in part]).to(device)
            else:
                flat = torch.empty(sum(_numel(s) for _, s, _ in part), dtype=dtype, device=device)
            group.broadcast(flat, source)
            values = flat.cpu().split([_numel(s) for _, s, _ in part])
            for (key, shape, _), value in zip(part, values, strict=True):
                full[key] = mine[key] if source == comm.rank else value.view(shape).clone()
    return {k: full[k] for k in order if k in full}


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out
