"""A workload: the model, its loss and its data, named by a plan's `workload: module:function`."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from torch import nn

from zerocc.errors import PlanError
from zerocc.plan import Plan

__all__ = ["Workload", "load_workload"]


@dataclass
class Workload:
    """What `zerocc train` trains: a model, an optional loss, and each rank's batches.

    `batches(rank, world_size)` yields this rank's local batches, each a tuple of tensors passed
    as `step(*batch)`; every rank must get different data, as under DDP. `loss_fn(model, *batch)`
    returns a scalar; None means `model(*batch)` (or its `.loss`). Only `model` may be passed
    positionally, so `Workload(model, loss_fn, batches)` fails loudly instead of mixing them up.
    """

    model: nn.Module
    _: KW_ONLY
    loss_fn: Callable | None = None
    batches: Callable[[int, int], Iterator[tuple]]


def load_workload(plan: Plan) -> Workload:
    """Import `plan.workload` ("module:function") and call it with `plan.workload_args`.

    The module is imported with the plan file's directory (then the cwd) first on sys.path, so a
    plan can name a `workload.py` that sits next to it. Raises PlanError naming the module or
    function when it cannot be imported, found, called with the arguments, or returns no Workload.
    """
    if plan.workload is None:
        raise PlanError("workload: the plan names no workload; set workload: 'module:function'")
    module_name, function_name = plan.workload.split(":")
    plan_dir = Path(plan.source).resolve().parent if plan.source else Path.cwd()
    search = [str(plan_dir), os.getcwd()]

    saved_path = list(sys.path)
    sys.path[:0] = search
    try:
        _forget_if_shadowed(module_name, plan_dir)
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(
            f"workload: cannot import module {module_name!r} (searched {', '.join(search)} and "
            f"sys.path): {exc}"
        ) from None
    finally:
        sys.path[:] = saved_path

    function = getattr(module, function_name, None)
    if not callable(function):
        raise PlanError(
            f"workload: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
            f"function {function_name!r}"
        )
    try:
        inspect.signature(function).bind(**plan.workload_args)
    except TypeError as exc:
        raise PlanError(f"workload_args: cannot call {plan.workload}: {exc}") from None
    except ValueError:  # no signature to check (a builtin): let the call itself tell
        pass

    workload = function(**plan.workload_args)
    if not isinstance(workload, Workload):
        raise PlanError(
            f"workload: {plan.workload} returned {type(workload).__name__}, not a "
            "zerocc.workload.Workload"
        )
    return workload


def _forget_if_shadowed(module_name: str, plan_dir: Path) -> None:
    """Drop a cached module of the same name imported from elsewhere (e.g. another plan's
    `workload.py`), so the plan's own module is the one imported."""
    top = module_name.split(".")[0]
    cached = sys.modules.get(top)
    local = plan_dir / f"{top}.py"
    if not local.exists():
        local = plan_dir / top / "__init__.py"
    if cached is None or not local.exists():
        return
    cached_file = getattr(cached, "__file__", None)
    if cached_file is None or Path(cached_file).resolve() != local.resolve():
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
