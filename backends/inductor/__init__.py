"""The Inductor backend: compute lowered by TorchInductor, zerocc's ops as scheduled.

``backend.name: inductor``. :func:`compile` binds the program as the eager backend does and
compiles each compute region between zerocc's ops with Inductor (Triton kernels on a GPU, C++
on a CPU); see :mod:`zerocc.backends.inductor.executable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from zerocc.backends.inductor.executable import InductorExecutable
from zerocc.runtime.context import RuntimeContext


def compile(
    program: fx.GraphModule, example_inputs: Sequence[Any], ctx: RuntimeContext
) -> InductorExecutable:
    """An executable of ``program`` on ``ctx`` with its compute regions compiled by Inductor
    (on the regions' fake input values: nothing runs before the first call)."""
    return InductorExecutable(program, ctx)
