"""A GPU's free memory read through NVML, the driver's management library, without a CUDA
context.

`zerocc train` checks the model states of the ranks it is about to start against their GPUs'
memory before it launches any. ``torch.cuda.mem_get_info`` would create a CUDA context on each
GPU in the launcher, which holds hundreds of MiB of every GPU for the whole run; NVML reads the
same figure from the driver and holds nothing. It is read with ctypes from the driver's
``libnvidia-ml.so.1`` (what ``torch.cuda`` itself opens to count devices), so nothing is added
to the install. Where the library or a call fails (no driver, a container without it) the
answer is None, and the ranks check the GPU's memory themselves once started.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

_LIBRARY = "libnvidia-ml.so.1"


class _Memory(ctypes.Structure):
    """``nvmlMemory_t``: bytes of the device's memory."""

    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def _open() -> Any:
    return ctypes.CDLL(_LIBRARY)


def _nvml_index(index: int) -> int:
    """The NVML index of CUDA device ``index`` under ``CUDA_VISIBLE_DEVICES`` (torch's own
    mapping, which reads the variable as CUDA does; the index itself where it cannot)."""
    try:
        return torch.cuda._get_nvml_device_index(index)
    except Exception:  # (a private function: absent, or the UUIDs unreadable)
        return index


def free_bytes(indices: list[int], library: Callable[[], Any] = _open) -> dict[int, int] | None:
    """Free bytes of each CUDA device in ``indices`` (as torch numbers them), or None where
    NVML cannot say (``library`` opens it: a test gives its own)."""
    try:
        nvml = library()
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        free = {}
        for index in indices:
            handle = ctypes.c_void_p()
            memory = _Memory()
            if nvml.nvmlDeviceGetHandleByIndex_v2(_nvml_index(index), ctypes.byref(handle)):
                return None
            if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)):
                return None
            free[index] = memory.free
        return free
    finally:
        nvml.nvmlShutdown()
