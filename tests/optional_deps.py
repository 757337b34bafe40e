"""What tests need of the optional dependencies, and how they skip (with the reason and the
install command, never silently) where one is missing.

Triton is optional (pyproject's ``triton`` and ``dev`` extras; torch's CUDA wheels bring it): the
``backend.kernels: triton`` cases skip where :func:`zerocc.backends.kernels.triton_problem`
says they cannot run, and are left out of the multi-rank runs there. So do the cases of a
Hugging Face model (tests/models.py's ``llama``) where transformers is missing (the ``dev``
and ``hf`` extras).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch
from models import MOE_MODELS

from zerocc.backends.kernels import triton_problem

TRITON_PROBLEM = triton_problem()
TRITON_REASON = f"backend.kernels: triton cannot run: {TRITON_PROBLEM}"
needs_triton = pytest.mark.skipif(TRITON_PROBLEM is not None, reason=TRITON_REASON)


# tests/models.py's models built by transformers
HF_MODELS = frozenset({"llama", "llama_dropout", *MOE_MODELS})
TRANSFORMERS_PROBLEM = (
    None
    if importlib.util.find_spec("transformers")
    else 'transformers is not installed: pip install -e ".[dev]"'
)


def _problem(case: dict[str, Any]) -> str | None:
    """Why ``case`` cannot run on this machine (None when it can)."""
    if case.get("kernels") == "triton" and TRITON_PROBLEM is not None:
        return TRITON_REASON
    if case.get("model") in HF_MODELS and TRANSFORMERS_PROBLEM is not None:
        return f"model {case['model']}: {TRANSFORMERS_PROBLEM}"
    return None


def runnable(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases this machine can run (those with ``kernels: triton`` only where it runs,
    those of a Hugging Face model only with transformers)."""
    return [c for c in cases if _problem(c) is None]


def marked(cases: list[Any], config: Any = lambda case: case) -> list[Any]:
    """``cases`` for ``parametrize``, those that ``config(case)`` says cannot run here marked
    to skip with the reason."""
    return [
        pytest.param(c, marks=pytest.mark.skip(reason=why)) if (why := _problem(config(c))) else c
        for c in cases
    ]


@functools.cache
def triton_fma_problem() -> str | None:
    """Why the Triton kernels cannot stand for the GPU's arithmetic here (None when they can):
    Triton missing, or its interpreter rounding an fma twice (Triton 3.6's multiplies, then
    adds; 3.9's and a GPU's fma round once). Tests that hold another kernel to them bit for
    bit skip with this reason."""
    if TRITON_PROBLEM is not None:
        return TRITON_REASON
    from zerocc.backends.kernels import triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p, g = torch.tensor([-1.0], device=device), torch.tensor([1 + 2**-12], device=device)
    triton_kernels.sgd_(p, g, None, None, None, None, 1.0, -(1 + 2**-12), 0.0, 0.0)
    if p.item() != 2**-11 + 2**-24:  # (1 + 2^-12)^2 - 1, exact in fp32; rounded twice: 2^-11
        return "Triton's interpreter here rounds an fma twice (a GPU's rounds once)"
    return None
