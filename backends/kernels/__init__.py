"""zerocc's own kernels, in kernel sets selected by the plan's ``backend.kernels``.

``torch`` (:mod:`.reference`) runs everywhere and is the oracle; ``triton``
(:mod:`.triton_kernels`) fuses each update into one pass over memory. Every set provides
``adamw_``, ``sgd_``, ``unscale_check_`` and ``pack`` with the signatures of the reference.
"""

from __future__ import annotations

import importlib
from types import ModuleType

KERNEL_SETS = {"torch": "reference", "triton": "triton_kernels"}


def kernel_set(name: str) -> ModuleType:
    """The module implementing kernel set ``name`` (imported on first use)."""
    return importlib.import_module(f"{__name__}.{KERNEL_SETS[name]}")
