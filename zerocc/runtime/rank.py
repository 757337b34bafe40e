"""What a rank launched by a zerocc command (`train`, `profile`) does around its work: end with its
launcher, resolve the plan's device (:mod:`zerocc.runtime.devices`), join the process group the
launcher set up, move batches to the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerocc.compiler.batch import as_batch
from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import workload_code
from zerocc.errors import ZeroccError
from zerocc.runtime.devices import join_default_group, rank_device
from zerocc.runtime.launch import end_with_launcher


@contextlib.contextmanager
def joined_group(plan: Plan) -> Iterator[tuple[int, int]]:
    """(rank, world size) for the body: the launcher's process group joined when
    ``WORLD_SIZE`` > 1 (NCCL on CUDA, gloo on CPU: the plan's device for this rank, checked
    before anything touches CUDA, see :func:`zerocc.runtime.devices.rank_device`), a world of one
    otherwise; the group is left at the end. ``zerocc.compile`` resolves the same device: use
    the step's ``device`` for batches. A rank of zerocc's launcher ends with it, however the
    launcher ends (:func:`zerocc.runtime.launch.end_with_launcher`)."""
    end_with_launcher()
    join_default_group(rank_device(plan))
    try:
        if dist.is_initialized():
            yield dist.get_rank(), dist.get_world_size()
        else:
            yield 0, 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def to_device(batch: Sequence[Any] | Mapping[str, Any], device: torch.device | str) -> tuple:
    """A workload's batch (values, or a mapping of them by name) as a step's call takes it,
    its tensors on ``device``."""
    return tuple(b.to(device) if isinstance(b, torch.Tensor) else b for b in as_batch(batch))


def first_batch(batches: Iterator[Sequence[Any]], plan: Plan, rank: int, world_size: int):
    """The first of this rank's batches; a workload that yields none is a clear error."""
    where = f"{plan.workload}: batches({rank}, {world_size})"
    with workload_code(where):
        first = next(batches, None)
    if first is None:
        raise ZeroccError(f"{where} yielded no batch")
    return first
