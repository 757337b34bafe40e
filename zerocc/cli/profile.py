"""``zerocc profile``: one rank's part, run under the launcher. Its rank 0 writes the
calibration that ``zerocc estimate --calibration`` and a plan's ``cost.calibration`` read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zerocc
from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import load_workload, workload_code
from zerocc.inspect.calibrate import calibrate
from zerocc.runtime.rank import first_batch, joined_group, to_device


def profile_rank(plan: Plan, output: Path, steps: int) -> int:
    """One rank of ``zerocc profile``: join the group, compile, calibrate; rank 0 writes."""
    with joined_group(plan) as (rank, world_size):
        workload = load_workload(plan)
        step = zerocc.compile(workload.model, plan, loss_fn=workload.loss_fn)
        data_rank, data_ranks = step.data_rank, step.data_parallel  # one batch per tp group
        batches = workload.batches(data_rank, data_ranks)
        first = first_batch(batches, plan, data_rank, data_ranks)
        step(*to_device(first, step.device))  # captures and compiles
        endless = _endless(batches, workload, data_rank, data_ranks)
        result = calibrate(step, endless, steps=steps)
        if rank == 0:
            output.parent.mkdir(parents=True, exist_ok=True)
            result.save(output)
            print(result.table())
            print(f"wrote {output}; use it with `zerocc estimate PLAN --calibration {output}` "
                  f"or `cost: {{calibration: {output.name}}}` in a plan next to it")  # fmt: skip
    return 0


def _endless(batches: Iterator, workload: Any, rank: int, world_size: int) -> Iterator:
    """The workload's batches, started again whenever they run out."""
    fresh = False
    while True:
        count = 0
        with workload_code(f"batches({rank}, {world_size})"):
            for count, batch in enumerate(batches, 1):  # noqa: B007 (count is read below)
                yield batch
        if fresh and count == 0:
            raise RuntimeError(f"batches({rank}, {world_size}) yielded no batch")
        batches, fresh = workload.batches(rank, world_size), True
