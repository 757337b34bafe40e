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

import math
from collections.abc import Sequence

import torch

from zerocc.compiler.capture import ParamInfo
from zerocc.compiler.parallel.pipeline_schedule import PipelineSchedule
from zerocc.compiler.parallel.stage_programs import StagedStep
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
                numel = sum(math.prod(s) for _, s, _ in part)
                flat = torch.empty(numel, dtype=dtype, device=device)
            group.broadcast(flat, source)
            values = flat.cpu().split([math.prod(s) for _, s, _ in part])
            for (key, shape, _), value in zip(part, values, strict=True):
                full[key] = mine[key] if source == comm.rank else value.view(shape).clone()
    return {k: full[k] for k in order if k in full}


def held_earlier(
    staged: StagedStep, schedule: PipelineSchedule, pp_rank: int, buffers: Sequence[ParamInfo]
) -> frozenset[str]:
    """What of pipeline rank ``pp_rank``'s state an earlier pipeline rank holds too, and so
    saves: a tied parameter, and the model's ``buffers`` (every rank holds them all) but those
    this rank is the first to read (one no stage reads: pipeline rank 0's)."""

    def reads(rank: int) -> set[str]:
        stages = [staged.stages[s] for s in schedule.stages_of(rank)]
        return {fqn for stage in stages for fqn in (*stage.params, *stage.buffers)}

    read = [reads(r) for r in range(schedule.pp)]
    every = {b.fqn for b in buffers}
    mine = read[pp_rank] - set().union(*read[:pp_rank])
    if pp_rank == 0:
        mine |= every - set().union(*read)
    return frozenset((read[pp_rank] | every) - mine)
