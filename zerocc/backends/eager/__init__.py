"""The eager backend: the reference that runs everywhere.

:func:`compile` binds a scheduled program to a runtime context (:class:`EagerExecutable`): the
program runs op by op as fx's generated Python, which drops each intermediate after its last
use; zerocc's ops run on the context's comm, copy engine and kernels
(:mod:`zerocc.backends.eager.ops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from zerocc.backends.eager.executable import EagerExecutable
from zerocc.engine import RuntimeContext


def compile(
    program: fx.GraphModule, example_inputs: Sequence[Any], ctx: RuntimeContext
) -> EagerExecutable:
    """An executable that runs ``program`` eagerly on ``ctx``; it is called with the program's
    placeholders in order (``example_inputs``: their fake values; eager needs none)."""
    return EagerExecutable(program, ctx)
