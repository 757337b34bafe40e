"""zerocc's own kernels, in kernel sets selected by the plan's ``backend.kernels``.

``torch`` (:mod:`.reference`) runs everywhere and is the oracle; ``fused`` (:mod:`.fused`)
runs the updates on torch's fused optimizer kernels (C++ on a CPU, multi-tensor on a GPU);
``one-pass`` (:mod:`.one_pass`) compiles a CPU update, its gradient's scaling and its compute
copy with Inductor into one loop (the host updates of offloaded units on a GPU machine run it
wherever it compiles); ``triton`` (:mod:`.triton_kernels`) fuses each update, with its
unscale, clip and cast, into one pass over memory. The fused sets read the non-finite flag on
the device, with no host sync.
Every set is a module that implements :class:`~zerocc.engine.kernel_set.KernelSet`, with the
reference's signatures and its results (tests/backends/kernels holds each set to the reference).
``auto`` (the default, :func:`resolve_kernels`) is ``triton`` where it runs compiled (a GPU, a
Triton it supports, fp32 master weights), else ``fused`` where torch has those kernels, else
``torch``.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import cast

import torch

from zerocc.engine.kernel_set import KernelSet
from zerocc.errors import NotSupportedError

KERNEL_SETS = {
    "torch": "reference",
    "fused": "fused",
    "one-pass": "one_pass",
    "triton": "triton_kernels",
}

# The oldest Triton the kernels are verified with: their tests pass interpreted (TRITON_INTERPRET=1)
# with 3.3 and later; under 3.0-3.2 (torch 2.4-2.6 bring them) most fail (wrong results, or the
# interpreter rejects the kernels). No GPU run says otherwise for the compiled kernels.
MIN_TRITON = (3, 3)
# zerocc does not depend on triton itself: torch's CUDA wheels bring the Triton they were built
# with, and on CPU it only interprets the kernels (for tests).
TRITON_INSTALL = (
    "torch's CUDA wheels bring it; otherwise `pip install triton` "
    '(from a zerocc checkout: `pip install -e ".[triton]"`)'
)


def resolve_kernels(name: str, device: torch.device, master: str) -> str:
    """The kernel set ``backend.kernels: name`` runs on ``device`` with ``precision.master``:
    ``auto`` is ``triton`` on a GPU whose Triton can run zerocc's kernels when the masters are
    fp32 (the only ones the Triton update writes), else ``fused`` where this torch has fused
    optimizer kernels for the device and the masters are fp32, else ``torch``; other names are
    themselves."""
    if name != "auto":
        return name
    if master != "fp32":
        return "torch"
    if device.type == "cuda" and triton_problem() is None:
        return "triton"
    return "fused" if kernel_set("fused").runs_on(device.type) else "torch"


def host_kernels() -> str:
    """The kernel set of the host updates of offloaded units on a GPU machine: ``one-pass``
    where it compiles, else ``fused`` where this torch has CPU fused kernels, else ``torch``."""
    for name in ("one-pass", "fused"):
        if kernel_set(name).runs_on("cpu"):
            return name
    return "torch"


def kernel_set(name: str) -> KernelSet:
    """The module implementing kernel set ``name`` (imported on first use)."""
    return cast(KernelSet, importlib.import_module(f"{__name__}.{KERNEL_SETS[name]}"))


def triton_problem() -> str | None:
    """Why the ``triton`` kernel set cannot run here (triton missing or too old), or None."""
    try:
        import triton
    except ImportError as e:
        return f"triton cannot be imported ({e}): {TRITON_INSTALL}"
    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if found is None or tuple(map(int, found.groups())) < MIN_TRITON:
        wanted = ".".join(map(str, MIN_TRITON))
        return (
            f"zerocc's Triton kernels need triton >= {wanted}, found {triton.__version__} "
            f"(torch >= 2.7 brings one; on CPU: `pip install -U triton`)"
        )
    return None


def check_kernels(name: str, device: torch.device) -> None:
    """Fail at compile time, not mid-step, when kernel set ``name`` cannot run on ``device``."""
    if name == "one-pass":
        if device.type != "cpu":
            raise NotSupportedError(
                f"backend.kernels: one-pass updates on the CPU, and this step runs on {device}; "
                "the host updates of offloaded units use it already: use backend.kernels: auto"
            )
        one_pass = importlib.import_module(f"{__name__}.{KERNEL_SETS[name]}")
        problem = one_pass.problem()  # compiled here, not in the first step
        if problem is not None:
            raise NotSupportedError(
                f"backend.kernels: one-pass cannot compile here ({problem}); "
                "use backend.kernels: fused"
            )
    if name != "triton":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise NotSupportedError(
            "backend.kernels: triton runs on a GPU; on CPU only interpreted, which is slow and "
            "meant for tests: set TRITON_INTERPRET=1 before starting Python, or use "
            "backend.kernels: torch"
        )
    problem = triton_problem()
    if problem is not None:
        raise NotSupportedError(
            f"backend.kernels: triton, but {problem}; or use backend.kernels: torch"
        )
