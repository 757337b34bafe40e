"""The Inductor backend: compute lowered by TorchInductor, zerocc's ops as scheduled.

``backend.name: inductor`` (and its former name ``inductor-regions``) compiles region by
region: the compute between zerocc's ops, cut where a repeated layer's copy begins, each
distinct region compiled once (a layer's copies run their first's code), zerocc's ops run as
the eager backend runs them, so the cold start does not grow with depth.
``backend.name: inductor-whole`` compiles the whole program as one graph, zerocc's ops in it
as kernels Inductor keeps in place (:mod:`zerocc.backends.inductor.whole`), so it fuses across
units and layers, at a compile time that grows with every layer; a program it cannot take
whole, it compiles region by region, and says why. Triton kernels on a GPU, C++ on a CPU; see
:mod:`zerocc.backends.inductor.executable`.
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
    """An executable of ``program`` on ``ctx`` with each distinct compute region between
    zerocc's ops compiled by Inductor once (on fake inputs: nothing runs before the first
    call)."""
    return InductorExecutable(program, ctx, whole=False)


def compile_whole(
    program: fx.GraphModule, example_inputs: Sequence[Any], ctx: RuntimeContext
) -> InductorExecutable:
    """An executable of ``program`` on ``ctx`` compiled by Inductor as one graph where it can
    be, else region by region."""
    return InductorExecutable(program, ctx, whole=True)
