"""What tests need of the optional dependencies, and how they skip (with the reason and the
install command, never silently) where one is missing.

Triton is optional (pyproject's ``triton`` and ``dev`` extras; torch's CUDA wheels bring it): the
``backend.kernels: triton`` cases skip where :func:`zerocc.backends.kernels.triton_problem`
says they cannot run, and are left out of the multi-rank runs there.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from zerocc.backends.kernels import triton_problem

TRITON_PROBLEM = triton_problem()
needs_triton = pytest.mark.skipif(
    TRITON_PROBLEM is not None, reason=f"backend.kernels: triton cannot run: {TRITON_PROBLEM}"
)


def _uses_triton(case: dict[str, Any]) -> bool:
    return case.get("kernels") == "triton"


def runnable(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases this machine can run (those with ``kernels: triton`` only where it runs)."""
    return [c for c in cases if TRITON_PROBLEM is None or not _uses_triton(c)]


def marked(cases: list[Any], config: Any = lambda case: case) -> list[Any]:
    """``cases`` for ``parametrize``, those whose ``config(case)`` uses triton marked with
    :data:`needs_triton`."""
    return [pytest.param(c, marks=needs_triton) if _uses_triton(config(c)) else c for c in cases]


@functools.cache
def triton_fma_problem() -> str | None:
    """Why the Triton kernels cannot stand for the GPU's arithmetic here (None when they can):
    Triton missing, or its interpreter rounding an fma twice (Triton 3.6's multiplies, then
    adds; 3.9's and a GPU's fma round once). Tests that hold another kernel to them bit for
    bit skip with this reason."""
    if TRITON_PROBLEM is not None:
        return f"backend.kernels: triton cannot run: {TRITON_PROBLEM}"
    from zerocc.backends.kernels import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p, g = torch.tensor([-1.0], device=device), torch.tensor([1 + 2**-12], device=device)
    triton_kernels.sgd_(p, g, None, None, None, None, 1.0, -(1 + 2**-12), 0.0, 0.0)
    if p.item() != 2**-11 + 2**-24:  # (1 + 2^-12)^2 - 1, exact in fp32; rounded twice: 2^-11
        return "Triton's interpreter here rounds an fma twice (a GPU's rounds once)"
    return None
