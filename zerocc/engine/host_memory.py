"""Host memory for offload: exactly the bytes asked for, page-locked only where a GPU copies.

torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two and
keeps it cached: a 20 GiB state takes 32, and a host holding offloaded states pinned that way
peaked at twice their size (issue 22: 16.6 GiB of states, 32.8 GB resident; a 7B run killed by
the out-of-memory killer though its states fit). Here a pinned tensor is a mapping of its own
(anonymous ``mmap``: whole pages, its size rounded up to one), registered with CUDA as it is
(``cudaHostRegister``, as torch's checkpoint stager and SGLang's host caches do) and
unregistered when its storage is freed. A mapping of its own, not the CPU allocator's memory:
two allocations that share a page could not both be registered. Small tensors (below
:data:`REGISTER_BYTES`) keep torch's pinned allocator, whose rounding costs little there.

What is pinned: only what a GPU copies to or from (a transfer's host result, the master
weights the compute copy is written from, parameters kept on the host), never the optimizer
moments, which only the host update reads. On a machine without a GPU nothing is.

:class:`HostBuffers` keeps the host results of a program's copies (an offloaded unit's reduced
gradient, each step) one per copy, allocated at the first step and reused after, so the host's
memory is steady from the first step on and the memory check's figure is what stays resident.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

from zerocc.compiler.state import DEVICE, HOST, StateSpec
from zerocc.ir.kinds import Role

REGISTER_BYTES = 1 << 20  # at and above: exact memory registered with CUDA


def _register(ptr: int, nbytes: int) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(ptr, nbytes)


def _unregister(ptr: int) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(ptr)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialized contiguous host tensor of exactly ``shape``'s bytes; ``pinned``:
    page-locked for asynchronous copies with a GPU (see the module's docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not pinned or nbytes < REGISTER_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    # The tensor keeps the mapping alive; it is unmapped when the storage goes.
    storage = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8).untyped_storage()
    ptr = storage.data_ptr()
    _register(ptr, size)
    # Unregistered when the storage goes (torch keeps its Python object as long as any tensor
    # holds the storage), not at interpreter exit, when CUDA may be gone already.
    weakref.finalize(storage, _unregister, ptr).atexit = False
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def state_tensor(spec: StateSpec, device: torch.device) -> torch.Tensor:
    """Uninitialized memory for state ``spec`` of a run on ``device``: on the device, or host
    memory of its exact size (an NVMe state's too, written to its file once), pinned on a GPU
    machine where a GPU copies the state (weights: the master the compute copy is written
    from, a parameter kept on the host), never for the optimizer moments."""
    if spec.location == DEVICE:
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)
    copied = spec.location == HOST and spec.role != Role.OPTIM_STATE
    return host_empty(spec.shape, spec.dtype, pinned=device.type == "cuda" and copied)


class HostBuffers:
    """The host results of a program's copies, one per copy (by the name of its start node),
    reused step after step."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: dict[str, torch.Tensor] = {}  # by copy

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer of copy ``key``: last step's, when it has this shape and dtype and the
        program did not free it, else a new one."""
        buffer = self.buffers.get(key)
        nbytes = math.prod(shape) * dtype.itemsize
        if (
            buffer is None
            or buffer.shape != shape
            or buffer.dtype != dtype
            or buffer.untyped_storage().nbytes() < nbytes  # freed (resized to 0) since
        ):
            buffer = self.buffers[key] = host_empty(shape, dtype, self.pinned)
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.untyped_storage().nbytes() for b in self.buffers.values())
