"""Rounding where eager rounds, on torch releases whose Inductor drops it.

Under ``emulate_precision_casts`` (set by the backend, :data:`~zerocc.backends.inductor.
executable.EAGER_NUMERICS`) Inductor is to round a value cast to bf16 or fp16 where eager
does, though it computes in fp32. Before torch 2.13 it dropped that rounding in two places,
both fixed upstream together (the fix cites pytorch/pytorch#185337):

- the joint-graph pattern ``pointless_convert`` folds ``x.to(bf16).to(fp32)`` into
  ``x.to(fp32)`` whatever the option says;
- the C++ kernels (Inductor on a CPU) take the widening of a narrowed value from their CSE
  cache as the value before the narrowing.

Measured on torch 2.11 (and the same code in 2.12.1), on this CPU: a fp16 program seeded with
loss scale 65536 (an fp16 infinity) got finite gradients where eager's overflow, so it took a
step eager skips; bf16 weights drifted to 1.15e-2 from the recipe in five AdamW steps (6.4e-3
on 2.13); ``(x * 3.3).to(bf16).float()`` compiled was ``x * 3.3`` unrounded.

:func:`rounding_as_eager` makes both places keep the rounding while zerocc compiles, as 2.13
does, and puts a marker into the key of Inductor's caches, so that a program compiled
without it (by an earlier zerocc) is never loaded in its place. On 2.13 and later it does
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

# In the key of the programs compiled under rounding_as_eager: a new number when it changes.
MARKER = "zerocc: rounding as eager, 1"
# explain()'s line for a 16-bit program compiled under the mend.
MENDED = (
    f"inductor: torch {torch.__version__} drops some of the rounding of 16-bit casts that "
    "Inductor is asked to keep; zerocc kept it while compiling "
    "(zerocc/backends/inductor/eager_casts.py)"
)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def torch_drops_rounding() -> bool:
    """Whether this torch's Inductor drops eager's 16-bit rounding under
    ``emulate_precision_casts`` (releases before the fix, which added
    ``joint_graph._is_lossless_fp_widening_cast``)."""
    from torch._inductor import config
    from torch._inductor.fx_passes import joint_graph

    has_option = hasattr(config, "emulate_precision_casts")
    return has_option and not hasattr(joint_graph, "_is_lossless_fp_widening_cast")


def mend_note(program: torch.fx.GraphModule) -> str | None:
    """``explain()``'s line (:data:`MENDED`) for ``program`` compiled under
    :func:`rounding_as_eager`; None where this torch keeps the rounding or the program holds
    no 16-bit value."""
    if not torch_drops_rounding():
        return None
    values = (n.meta.get("val") for n in program.graph.nodes)
    return MENDED if any(getattr(v, "dtype", None) in LOW_PRECISION for v in values) else None


@contextlib.contextmanager
def rounding_as_eager() -> Iterator[None]:
    """While zerocc compiles: keep a narrowing cast's rounding where this torch's Inductor
    drops it (see the module's docstring), and key the cache apart; nothing on a torch that
    keeps it. Inductor's ``emulate_precision_casts`` must be on, as the backend sets it."""
    if not torch_drops_rounding():
        yield
        return
    from torch._inductor import config
    from torch._inductor.codegen.cpp import CppKernel
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.fx_passes import joint_graph

    user_pass = config.joint_custom_pre_pass
    with contextlib.ExitStack() as stack:
        for entry in _entries_of(getattr(joint_graph, "pointless_convert", None)):
            stack.enter_context(mock.patch.object(entry, "handler", _keeping_narrow_casts))
        if hasattr(CppKernel, "cache_dtype_convert"):  # the C++ kernels' CSE of a round trip
            stack.enter_context(mock.patch.object(CppKernel, "cache_dtype_convert", _no_cache))
        # A user's own pass that is no CustomGraphPass already turns the cache off.
        if user_pass is None or isinstance(user_pass, CustomGraphPass):
            stack.enter_context(config.patch(joint_custom_pre_pass=_marker(user_pass)))
        yield


def _entries_of(handler: Any) -> list[Any]:
    """The joint-graph pattern entries whose handler is ``handler`` (none for None)."""
    from torch._inductor.fx_passes import joint_graph

    if handler is None:
        return []
    return [
        entry
        for entries in joint_graph.patterns.patterns.values()
        for entry in entries
        if getattr(entry, "handler", None) is handler
    ]


def _keeping_narrow_casts(match: Any, arg: Any, dtype1: torch.dtype, dtype2: torch.dtype) -> None:
    """``pointless_convert`` with torch 2.13's conditions: a chain ``arg -> dtype1 -> dtype2``
    that rounds (through a narrower dtype, or a ``dtype1`` that is no lossless widening of
    ``arg``) is kept; one that does not is folded, as before."""
    from torch._inductor.fx_passes import joint_graph

    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return
    if dtype1.itemsize < dtype2.itemsize or not _widens_losslessly(value.dtype, dtype1):
        return
    joint_graph.pointless_convert(match, arg, dtype1, dtype2)


def _widens_losslessly(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every ``source`` value is a ``target`` value (floating point, or the same)."""
    if source == target:
        return True
    floating = source.is_floating_point and target.is_floating_point
    return floating and target.itemsize > source.itemsize


def _no_cache(*args: Any) -> None:
    """In place of ``CppKernel.cache_dtype_convert``: remember no round trip."""


def _marker(user_pass: Any) -> Any:
    """A joint-graph pass that runs ``user_pass`` (if any) and whose uuid, in the key of
    Inductor's caches, carries :data:`MARKER`."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RoundingAsEager(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            if user_pass is not None:
                user_pass(graph)

        def uuid(self) -> Any:
            return (MARKER, None if user_pass is None else user_pass.uuid())

    return RoundingAsEager()
