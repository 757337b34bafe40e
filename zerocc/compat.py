"""The torch APIs whose name or place changed across the releases zerocc supports.

Each name here is resolved once, at import, to what the installed torch provides; the rest of
zerocc imports it from here instead of from torch, so that a release that renamed or moved it
is handled in one place. The supported range is ``project.dependencies`` in pyproject.toml
(docs/versions.md); every shim says which releases take which branch.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module as use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

# The single-tensor collectives: recent releases (2.13 has them, 2.11 not) name them
# ``all_gather_single`` and ``reduce_scatter_single`` and deprecate ``all_gather_into_tensor``
# and ``reduce_scatter_tensor`` (a FutureWarning on every call); older ones have only those.
# Same arguments under both names: (output, input, [op,] group=None, async_op=False).
all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", getattr(dist, "all_gather_into_tensor", None)
)
reduce_scatter_single: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", getattr(dist, "reduce_scatter_tensor", None)
)

try:  # torch >= 2.5: also finds a pre-dispatch tracing mode
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
except ImportError:  # torch 2.4: make_fx(pre_dispatch=False), which zerocc uses, is all there is
    from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode as get_proxy_mode


# LazyGraphModule, use_lazy_graph_module: a GraphModule whose Python code is generated when it
# is first read or run, not each time its graph is set, and the switch that makes make_fx return
# one (torch.fx's own, private in every release zerocc supports: 2.3 added them).

# make_fx's per-call torch-function mode (node.meta["torch_fn"], which zerocc does not read) can
# be turned off from torch 2.6 on; before, make_fx has no such option and always runs it.
MAKE_FX_OPTIONS: dict[str, Any] = (
    {"_disable_torch_fn_metadata_mode": True}
    if "_disable_torch_fn_metadata_mode" in inspect.signature(make_fx).parameters
    else {}
)


def let_gloo_workers_finish() -> None:
    """Call before the last reference to a destroyed process group is dropped. Releases before
    torch 2.8 run the group's destructor holding the GIL (2.8 releases it: pytorch#154976), and
    a gloo group's destructor joins its worker threads. A worker that has just finished a
    collective then frees the collective's tensors, and freeing the last reference to a tensor
    Python has seen takes the GIL: the destructor would wait for the worker forever (a rank
    hangs where a TrainStep is dropped). Sleeping releases the GIL long enough for such a
    worker to finish; nothing to do on later releases."""
    if torch.__version__ < "2.8":
        time.sleep(0.05)


__all__ = [
    "MAKE_FX_OPTIONS",
    "LazyGraphModule",
    "all_gather_single",
    "get_proxy_mode",
    "let_gloo_workers_finish",
    "reduce_scatter_single",
    "use_lazy_graph_module",
]
