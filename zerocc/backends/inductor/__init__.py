"""The Inductor backend: compute lowered by TorchInductor, zerocc's ops as scheduled.

``backend.name: inductor`` compiles the whole program as one graph, zerocc's ops in it as
kernels Inductor keeps in place (:mod:`zerocc.backends.inductor.whole`), so it fuses across
units; a program it cannot take whole, it compiles region by region (the compute between
zerocc's ops, each region compiled, zerocc's ops run as the eager backend runs them), and says
why. ``backend.name: inductor-regions`` always compiles region by region. Triton kernels on a
GPU, C++ on a CPU; see :mod:`zerocc.backends.inductor.executable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from zerocc.backends.inductor.executable import InductorExecutable
from zerocc.engine import RuntimeContext


def compile(
    program: fx.GraphModule, example_inputs: Sequence[Any], ctx: RuntimeContext
) -> InductorExecutable:
    """An executable of ``program`` on ``ctx`` compiled by Inductor, whole where it can be
    (on fake inputs: nothing runs before the first call)."""
    return InductorExecutable(program, ctx, whole=True)


def compile_regions(
    program: fx.GraphModule, example_inputs: Sequence[Any], ctx: RuntimeContext
) -> InductorExecutable:
    """An executable of ``program`` on ``ctx`` with each compute region between zerocc's ops
    compiled by Inductor."""
    return InductorExecutable(program, ctx, whole=False)
