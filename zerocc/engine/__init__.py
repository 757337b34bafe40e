"""The engine a program runs on, and what a backend binds an executable to: the rank's process
groups and heartbeat (:mod:`.comm`), the copy engine (:mod:`.transfers`), host memory and the
host's update worker, failure reports; :class:`RuntimeContext` holds one of each with the
kernel set and the device. One per step runner; a recorder (calibration) may swap the comm
for its run. Below the backends, which run on it, and the runtime, which builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerocc.engine.comm import Comm
from zerocc.engine.host_worker import HostWorker
from zerocc.engine.kernel_set import KernelSet
from zerocc.engine.payloads import Payloads
from zerocc.engine.transfers import Transfers


@dataclass(frozen=True)
class RuntimeContext:
    """The runtime an executable's ops run on. ``kernels``: the kernel set of the plan's
    ``backend.kernels`` (:func:`zerocc.backends.kernels.kernel_set`); ``device``: the device
    the step computes on (CUDA streams belong to the comm and the copy engine); ``host``: the
    worker that runs the host updates an offload defers (``offload.defer_updates``);
    ``payloads``: what expert parallelism's exchanges received, kept between its ops."""

    comm: Comm
    transfers: Transfers
    kernels: KernelSet
    device: torch.device
    host: HostWorker = field(default_factory=HostWorker)
    payloads: Payloads = field(default_factory=Payloads)
