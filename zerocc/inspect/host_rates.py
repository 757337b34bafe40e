"""The offload rates of a GPU machine, measured for `zerocc profile`: the host's update and the
copies between host and device.

The cost model times an offloaded unit's host update as the bytes it moves over
``host_memory_bytes_per_s`` and a copy as its bytes over ``host_link_bytes_per_s``
(:mod:`zerocc.cost.model`). Their defaults are a guess at a server's; the prediction of an
offloaded step is only as good as they are (issue 22: a 1.3B step predicted at 335 ms ran
4.98 s). So a calibration of a plan that offloads its optimizer on a GPU measures both:

- **host memory**: the host updates' kernel set (:func:`zerocc.backends.kernels.host_kernels`)
  runs AdamW on an fp32 shard of :data:`UPDATE_NUMEL` elements with a bf16 compute copy, on
  the rank's threads (pinned to its cores as in training), and the bytes the cost model counts
  for that update over its median time are the rate: the model then predicts that update's
  time exactly, and others by their bytes;
- **host link**: :data:`COPY_BYTES` copied from pinned host memory to the device and back, the
  mean of the two directions' median rates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from zerocc.backends.kernels import host_kernels, kernel_set
from zerocc.engine.host_memory import host_empty
from zerocc.engine.kernel_set import AdamWHyper

UPDATE_NUMEL = 1 << 24  # a shard larger than any cache, as an offloaded unit's is
COPY_BYTES = 256 << 20
# The bytes the cost model counts for an AdamW update of one element with a bf16 copy: every
# tensor argument read (weights, gradient, two moments: fp32; the copy: bf16), and those it
# writes (weights, moments, copy) written.
ADAMW_BYTES_PER_ELEMENT = (4 * 4 + 2) + (3 * 4 + 2)


def _median_seconds(run: Callable[[], None], reps: int) -> float:
    run()  # warm up (and compile, the first time)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_update_rate(numel: int = UPDATE_NUMEL, reps: int = 5) -> dict[str, float]:
    """The host updates' rate: bytes per second as the cost model counts them, with the
    median seconds of one update of ``numel`` elements and the kernel set that ran it."""
    name = host_kernels()
    kernels = kernel_set(name)
    param, grad, exp_avg, exp_avg_sq = (torch.rand(numel) for _ in range(4))
    copy = torch.empty(numel, dtype=torch.bfloat16)
    step = torch.ones((), dtype=torch.int64)
    hyper = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)

    def update() -> None:
        kernels.adamw_(param, grad, exp_avg, exp_avg_sq, step, None, None, copy, hyper)

    seconds = _median_seconds(update, reps)
    moved = ADAMW_BYTES_PER_ELEMENT * numel
    return {"bytes_per_s": moved / seconds, "seconds": seconds, "numel": numel, "kernels": name}


def host_link_rate(device: torch.device, nbytes: int = COPY_BYTES, reps: int = 5) -> float:
    """Bytes per second between pinned host memory and ``device``: the mean of the two
    directions' median rates."""
    host = host_empty((nbytes,), torch.uint8, pinned=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)

        return run

    rates = [nbytes / _median_seconds(copy(a, b), reps) for a, b in ((on_device, host),
                                                                   (host, on_device))]  # fmt: skip
    return statistics.mean(rates)
