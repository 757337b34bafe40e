"""What a backend binds an executable to: the rank's process group, copy engine, kernels and
device. One per step runner; a recorder (calibration) may swap the comm for its run."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from zerocc.runtime.comm import Comm
from zerocc.runtime.host_worker import HostWorker
from zerocc.runtime.transfers import Transfers


@dataclass(frozen=True)
class RuntimeContext:
    """The runtime an executable's ops run on. ``kernels``: the kernel set of the plan's
    ``backend.kernels`` (:func:`zerocc.backends.kernels.kernel_set`); ``device``: the device
    the step computes on (CUDA streams belong to the comm and the copy engine); ``host``: the
    worker that runs the host updates of a pipelined offload."""

    comm: Comm
    transfers: Transfers
    kernels: ModuleType
    device: torch.device
    host: HostWorker = field(default_factory=HostWorker)
