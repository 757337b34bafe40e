"""``zerocc.compile(model, "auto", example=batch)``: the plan `zerocc plan auto` would choose
for this run, found by every rank before it compiles (the library's entry to the plan search;
``zerocc.searched_plan`` is this module's :func:`searched_plan`).

The search (:mod:`zerocc.inspect.plan_search`) compiles each candidate on fake tensors from one
example micro-batch and ranks them with the cost model's rates for this rank's device. Every
rank searches with the same inputs, the memory a rank has being the least any rank reports, so
every rank chooses the same plan; rank 0 prints the table and the choice.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from zerocc.compiler.batch import as_batch
from zerocc.compiler.capture import LossFn
from zerocc.compiler.driver.plan_changes import derive_plan
from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import Workload
from zerocc.cost.rates import rates_for
from zerocc.engine.comm import Comm
from zerocc.errors import PlanError, ZeroccError
from zerocc.inspect.plan_search import Search, search_plans
from zerocc.local_ranks import ranks_on_this_machine
from zerocc.runtime.machine_memory import DEVICE_POOL, HOST_POOL, available_memory


def searched_plan(
    model: nn.Module,
    plan: Plan,
    loss_fn: LossFn | None,
    example: Any,
    comm: Comm,
    device: torch.device,
) -> tuple[Plan, Search]:
    """``plan`` with the search's choice for ``comm``'s ranks on ``device`` (the fields the
    plan's data set are kept), and the search. ``example``: one micro-batch as the step takes
    it (a tuple of the model's arguments, or a mapping of them by name)."""
    if example is None:
        raise PlanError(
            "plan 'auto' searches on an example batch: pass example=... to zerocc.compile (one "
            "micro-batch of this rank, as the step takes it)"
        )
    batch = as_batch(example)
    workload = Workload(model, loss_fn=loss_fn, batches=lambda rank, world: iter([batch]))
    # (ranks on this machine: torchrun's count, else every rank on one machine)
    local_ranks = ranks_on_this_machine(unknown=comm.world_size)
    memory = min(comm.all_gather_object(_memory_per_rank(device, local_ranks)))
    rates = rates_for(plan, device.type)
    search = search_plans(plan, comm.world_size, memory, rates, workload, local_ranks)
    if comm.rank == 0:
        print(search.format(), file=sys.stderr, flush=True)
    best = search.best
    if best is None:
        raise ZeroccError("plan 'auto': no candidate plan fits; see the table above")
    chosen = derive_plan(plan, best.fields) if best.fields else plan
    if chosen is None:  # (a candidate is a plan the schema took once already)
        raise ZeroccError(f"plan 'auto': the choice {best.describe()} does not load")
    return chosen, search


def _memory_per_rank(device: torch.device, local_ranks: int) -> int:
    """What this rank has: its GPU's free memory, or on a CPU its share of the machine's."""
    available = available_memory(device)
    if device.type == "cuda":
        return available[DEVICE_POOL]
    return available[HOST_POOL] // max(local_ranks, 1)
