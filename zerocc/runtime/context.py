"""What a rank's programs run on, set up once by its step runner: the kernel set (checked for
the device), the NVMe store of the states placed there (checked for room before anything is
written), the copy engine over it, the host worker and, where updates run on the host of a GPU
machine, their kernel set (compiled here, one-pass, not in a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerocc.backends.kernels import check_kernels, host_kernels, kernel_set, resolve_kernels
from zerocc.compiler.plan import Plan
from zerocc.compiler.state import NVME, StateLayout
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import Comm
from zerocc.engine.host_worker import HostWorker, pin_host_update_threads
from zerocc.engine.transfers import Transfers
from zerocc.runtime.nvme import NvmeStore, open_store
from zerocc.runtime.programs import SetupClock


@dataclass
class StepContext:
    """A step runner's runtime context and what it was made of."""

    context: RuntimeContext  # what executables run on: comm, copy engine, kernels, host worker
    nvme: NvmeStore | None  # the files of the states placed on NVMe
    kernels: str  # the kernel set of updates (backend.kernels, resolved)
    host_kernels: str | None  # the kernel set of host updates on a GPU machine


def open_context(
    plan: Plan, comm: Comm, device: torch.device, layout: StateLayout, clock: SetupClock
) -> StepContext:
    """The runtime context of ``plan``'s programs on ``comm``'s rank and ``device``, for the
    states of ``layout``; ``clock`` accounts the host kernels' compile time."""
    kernels = resolve_kernels(plan.backend.kernels, device, plan.precision.master)
    check_kernels(kernels, device)
    nvme = open_store(plan, comm.rank, layout.at(NVME))
    host = HostWorker(threaded=device.type == "cuda")
    context = RuntimeContext(comm, Transfers(nvme, device), kernel_set(kernels), device, host)
    on_host = None
    if plan.offload.updates_on_host(device):
        pin_host_update_threads()
        with clock.timed("host update kernels"):
            on_host = host_kernels()
    return StepContext(context, nvme, kernels, on_host)
