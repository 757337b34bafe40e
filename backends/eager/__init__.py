"""The eager backend: the reference that runs everywhere.

The program runs op by op as fx's generated Python, which drops each intermediate after its last
use; zerocc's ops do the rest (collectives on the active comm, gathered buffers released at
``free``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zerocc.backends.eager.ops  # noqa: F401  (registers the eager implementations)
from torch import fx


def compile(gm: fx.GraphModule) -> Callable[..., Any]:
    """A callable that runs ``gm`` eagerly; arguments are the program's placeholders in order."""
    gm.recompile()
    return gm
