"""The copy engine: runs the offload ops' copies between the device, host memory and NVMe.

The offload pass moves state with four start/wait ops (``copy_start``, ``copy_into_start``,
``nvme_read_start``, ``nvme_write_start``: schemas in :mod:`zerocc.ir.ops`); their ``direction``
names the traffic for :class:`TransferStats`.

A :class:`Transfers` engine runs them, one per rank's step (a backend's executable calls it). On a
GPU, copies run on two copy streams per device, one per direction (PCIe moves both ways at
once: a gradient's copy to the host does not queue behind the parameters' copies in), each
ordered after the compute stream's work so far (a copy of a few bytes, such as the step's
scalars, on the compute stream itself, so that it does not queue behind the bulk copies);
waiting on a copy that reads or writes host memory blocks the host (the CPU reads the result
next, the host optimizer update, or writes the source next, a host buffer used in turn),
waiting on a copy between devices makes the compute stream wait on an event. A copy between
two host tensors (``host_to_host``) is done inline. On a CPU-only machine every copy is a
memcpy done inline (the same cores compute; there is nothing to overlap) and only NVMe I/O
runs in the background, on the store's threads.

Host memory (:mod:`zerocc.engine.host_memory`): a copy's host result is the same
buffer every step (:class:`~zerocc.engine.host_memory.HostBuffers`), of its exact size,
pinned when a GPU takes part, as is each ``host_buffer`` of a program (the offload pass's
staging of compute copies, which host updates write so that no copy to the device changes the
dtype: torch would cast such a copy into a new pageable tensor and copy from it synchronously).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from zerocc.engine.host_memory import HostBuffers, host_empty
from zerocc.ir.ops import CPU, INLINE_COPY_BYTES


@dataclass
class TransferStats:
    """Bytes moved per direction since the last :meth:`reset`."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, direction: str, tensor: torch.Tensor) -> None:
        self.bytes[direction] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.bytes.clear()


class _Done:
    """The handle of a transfer that completed when it was issued."""

    def wait(self) -> None:
        return None


class _CudaCopy:
    """A copy on the copy stream: one that reads or writes host memory is waited on by the
    host (which reads what came, or writes the source next: a host update writing a staging
    buffer that a copy to the device still reads would change what arrives), a copy between
    devices by the compute stream."""

    def __init__(self, event: torch.cuda.Event, host_waits: bool) -> None:
        self._event, self._host_waits = event, host_waits

    def wait(self) -> None:
        if self._host_waits:
            self._event.synchronize()
        else:
            torch.cuda.current_stream().wait_event(self._event)


class _ReadThenCopy:
    """An NVMe read into a pinned host buffer, copied to the device when waited on."""

    def __init__(self, read: Any, staging: torch.Tensor, out: torch.Tensor) -> None:
        self._read, self._staging, self._out = read, staging, out

    def wait(self) -> None:
        self._read.wait()
        self._out.copy_(self._staging)


class Transfers:
    """Runs the transfer ops of one rank: copies (a copy stream on a GPU) and NVMe I/O through
    ``store`` (a :class:`zerocc.runtime.nvme.NvmeStore`, when the plan offloads to NVMe), for a step
    that computes on ``device`` (host buffers are pinned when that is a GPU)."""

    def __init__(self, store: Any = None, device: torch.device = CPU) -> None:
        self.store = store
        self.device = device
        self.stats = TransferStats()
        self.host_buffers = HostBuffers(pinned=device.type == "cuda")
        self._streams: dict[tuple[torch.device, bool], torch.cuda.Stream] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> Any:
        """``dst`` receives ``src`` (cast to ``dst``'s dtype); on the copy stream, or a small
        one (:data:`~zerocc.ir.ops.INLINE_COPY_BYTES`) on the compute stream."""
        self.stats.record(direction, dst)
        gpu = dst if dst.is_cuda else src if src.is_cuda else None
        if gpu is None:
            dst.copy_(src)
            return _Done()
        compute = torch.cuda.current_stream(gpu.device)
        stream = compute
        if dst.numel() * dst.element_size() > INLINE_COPY_BYTES:
            stream = self._stream(gpu.device, to_device=dst.is_cuda)
            stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)
        return _CudaCopy(event, host_waits=not (dst.is_cuda and src.is_cuda))

    def read(self, key: str, out: torch.Tensor, direction: str) -> Any:
        """``out`` receives the state file of ``key``."""
        self.stats.record(direction, out)
        store = self._store()
        if not out.is_cuda:
            return store.read(key, out)
        staging = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        return _ReadThenCopy(store.read(key, staging), staging, out)

    def write(self, key: str, src: torch.Tensor, direction: str) -> Any:
        """The state file of ``key`` receives ``src`` (a host tensor)."""
        self.stats.record(direction, src)
        return self._store().write(key, src)

    def _store(self) -> Any:
        if self.store is None:
            raise RuntimeError("a program reads NVMe state, but no NVMe store is active")
        return self.store

    def empty(
        self,
        device: torch.device,
        shape: Any,
        dtype: torch.dtype,
        like: torch.Tensor,
        key: str | None = None,
    ) -> torch.Tensor:
        """An empty tensor for a transfer's result. The host result of copy ``key`` (its start
        node's name: a copy to the host) is the copy's buffer, the same every step. Host memory
        is pinned when a GPU takes part (not merely when the machine has one: a CPU rank would
        make a CUDA context for it)."""
        if device.type == "cpu" and key is not None:
            return self.host_buffers.get(key, tuple(shape), dtype)
        pinned = device.type == "cpu" and (like.is_cuda or self.device.type == "cuda")
        if pinned:
            return host_empty(tuple(shape), dtype, pinned=True)
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def _stream(self, device: torch.device, to_device: bool) -> torch.cuda.Stream:
        """The copy stream of ``device`` for copies into it (``to_device``) or out of it."""
        key = (device, to_device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]
