"""Bytes of the persistent state a rank holds, measured on its tensors and NVMe files."""

from __future__ import annotations

import torch

from zerocc.compiler.state import LOCATIONS, NVME, StateLayout
from zerocc.cost.memory import STATE_CATEGORY
from zerocc.runtime.nvme import NvmeStore


def state_bytes_by_location(
    state: dict[str, torch.Tensor],
    layout: StateLayout,
    store: NvmeStore | None,
) -> dict[str, dict[str, int]]:
    """Bytes of a rank's persistent params, grads and optimizer states (measured) in each
    place they live: ``device``, ``host`` (offload to cpu: on a CPU-only machine, the pool
    apart from the compute's) and ``nvme`` (the files of the rank's store). ``layout``: every
    state of the plan."""
    out = {where: dict.fromkeys(("params", "grads", "optimizer"), 0) for where in LOCATIONS}
    seen: set[int] = set()
    for key, tensor in state.items():
        spec = layout.get(key)
        storage = tensor.untyped_storage()
        if spec is None or storage.data_ptr() in seen:
            continue  # a view of another state tensor (stage 1-2 shards) is no extra memory
        seen.add(storage.data_ptr())
        out[spec.location][STATE_CATEGORY[spec.role]] += storage.nbytes()
    for spec in layout.at(NVME):
        if store is not None:
            out[NVME][STATE_CATEGORY[spec.role]] += store.path_of(spec.key).stat().st_size
    for pool in out.values():
        pool["total"] = sum(pool.values())
    return out
