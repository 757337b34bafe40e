"""What tests need of the optional dependencies, and how they skip (with the reason and the
install command, never silently) where one is missing.

Triton is optional (pyproject's ``triton`` and ``dev`` extras; torch's CUDA wheels bring it): the
``backend.kernels: triton`` cases skip where :func:`zerocc.backends.kernels.triton_problem`
says they cannot run, and are left out of the multi-rank runs there.
"""

from __future__ import annotations

from typing import Any

import pytest

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
