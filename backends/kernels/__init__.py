"""zerocc's own kernels, in kernel sets selected by the plan's ``backend.kernels``.

``torch`` (:mod:`.reference`) runs everywhere and is the oracle; ``triton``
(:mod:`.triton_kernels`) fuses each update into one pass over memory. Every set provides
``adamw_``, ``sgd_``, ``unscale_check_``, ``nonfinite_flags`` and ``pack`` with the signatures
of the reference.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from zerocc.errors import NotSupportedError

KERNEL_SETS = {"torch": "reference", "triton": "triton_kernels"}


def kernel_set(name: str) -> ModuleType:
    """The module implementing kernel set ``name`` (imported on first use)."""
    return importlib.import_module(f"{__name__}.{KERNEL_SETS[name]}")


def check_kernels(name: str, device: torch.device) -> None:
    """Fail at compile time, not mid-step, when kernel set ``name`` cannot run on ``device``."""
    if name != "triton":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise NotSupportedError(
            "backend.kernels: triton runs on a GPU; on CPU only interpreted, which is slow and "
            "meant for tests: set TRITON_INTERPRET=1 before starting Python, or use "
            "backend.kernels: torch"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise NotSupportedError(
            f"backend.kernels: triton, but triton cannot be imported ({e}); pip install triton"
        ) from None
