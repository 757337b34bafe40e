"""A workload: the model, its loss and its data, named by a plan's `workload: module:function`."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from zerocc.compiler.plan import Plan
from zerocc.errors import PlanError, ZeroccError
from zerocc.logs import torchao_import_quiet

__all__ = ["Workload", "load_workload", "plan_relative", "workload_code", "workload_function"]

# A workload's batch: values passed as step(*batch), or a mapping of them by name, step(**batch).
Batch = Sequence[Any] | Mapping[str, Any]

# The folder of the plan whose workload function is running (None outside one, or for a plan
# given as a dict): the workload's relative paths are read from there.
_PLAN_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("plan_dir", default=None)


def plan_relative(path: str | os.PathLike) -> Path:
    """``path`` as a workload reads it: relative to the folder of the plan that names the
    workload (while its function runs under `load_workload`), else to the current directory;
    ``~`` expanded. So `workload_args: {data: data.jsonl}` means the file beside the plan."""
    path = Path(path).expanduser()
    base = _PLAN_DIR.get()
    return path if path.is_absolute() or base is None else base / path


@dataclass
class Workload:
    """What `zerocc train` trains: a model, an optional loss, and each rank's batches.

    `batches(rank, world_size)` yields this rank's local batches, each a tuple (or list) of
    tensors passed as `step(*batch)`, or a mapping of them by name (a tokenizer's output) passed
    as `step(**batch)`; every rank must get different data, as under DDP. `loss_fn(model, *batch)`
    returns a scalar; None means `model(*batch)` (or its `.loss`). Only `model` may be passed
    positionally, so `Workload(model, loss_fn, batches)` fails loudly instead of mixing them up.
    `eval_batches(rank, world_size)`, when given, yields this rank's share of held-back data
    (batches shaped as the training ones); `zerocc train --eval-every N` reports the mean loss
    over all of it every N steps. `tokens_per_batch`, when given, counts the tokens of one
    local batch, for the tokens/s `zerocc train` shows (None: not shown).
    """

    model: nn.Module
    _: KW_ONLY
    loss_fn: Callable | None = None
    batches: Callable[[int, int], Iterator[Batch]]
    eval_batches: Callable[[int, int], Iterator[Batch]] | None = None
    tokens_per_batch: Callable[[Batch], int] | None = None


def load_workload(plan: Plan) -> Workload:
    """Import `plan.workload` ("module:function", or "path/to/file.py:function") and call it
    with `plan.workload_args`.

    The workload is code: importing it runs it, as running a training script would. The module
    is found in the plan file's folder first, then in installed packages (sys.path), never in
    the current directory unless that is the plan's folder: a plan names the code next to it,
    not whatever file of that name sits where the command happens to run. A file is read
    relative to the plan's folder, and its own folder is searched first for its imports. A plan
    given as a dict or Plan has no folder: its workload comes from installed packages (or a
    file relative to the current directory). The function runs with the same search path, so
    its own imports resolve the same way. Raises PlanError naming the module or function when
    it cannot be imported (with where it searched), found, called with the arguments, or
    returns no Workload; and when its own code raises, importing or calling it: the exception
    and the traceback of the workload's frames (the exception as the error's cause).
    """
    function, plan_dir = workload_function(plan)
    with _search_path(_folder_of(plan, plan_dir)), torchao_import_quiet():
        token = _PLAN_DIR.set(plan_dir)
        try:
            with workload_code(f"calling {plan.workload}(**workload_args)"):
                workload = function(**plan.workload_args)
        finally:
            _PLAN_DIR.reset(token)
    if not isinstance(workload, Workload):
        raise PlanError(
            f"workload: {plan.workload} returned {type(workload).__name__}, not a zerocc.Workload"
        )
    return workload


def workload_function(plan: Plan) -> tuple[Callable, Path | None]:
    """The function `plan.workload` names, imported and checked against `workload_args`
    without calling it (what `zerocc plan check` and every command check before a rank
    starts), and the plan's folder; PlanError as :func:`load_workload` says."""
    if plan.workload is None:
        raise PlanError("workload: the plan names no workload; set workload: 'module:function'")
    module_name, function_name = plan.workload.rsplit(":", 1)
    plan_dir = Path(plan.source).resolve().parent if plan.source else None
    # (torchao_import_quiet: a module importing transformers imports torchao where it is
    # installed, whose import warns of kernel libraries no zerocc run uses)
    with _search_path(_folder_of(plan, plan_dir)) as searched, torchao_import_quiet():
        if module_name.endswith(".py"):
            module = _import_file(plan_relative_to(plan_dir, module_name))
        else:
            try:
                _forget_if_found_elsewhere(module_name)
                with workload_code(f"importing module {module_name!r}", importing=True):
                    module = importlib.import_module(module_name)
            except ImportError as exc:
                raise PlanError(
                    f"workload: cannot import module {module_name!r}: {exc}; searched "
                    f"{searched}{_cwd_hint(module_name, plan_dir)}"
                ) from None
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
    return function, plan_dir


def plan_relative_to(plan_dir: Path | None, path: str) -> Path:
    """``path`` relative to ``plan_dir`` (the current directory for a plan without one)."""
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() or plan_dir is None else plan_dir / resolved


def _folder_of(plan: Plan, plan_dir: Path | None) -> Path | None:
    """The folder searched first for the workload's imports: a workload file's own, else the
    plan's."""
    module_name = (plan.workload or "").rsplit(":", 1)[0]
    if module_name.endswith(".py"):
        return plan_relative_to(plan_dir, module_name).resolve().parent
    return plan_dir


def _import_file(path: Path) -> ModuleType:
    """The module of a workload file, imported once per process (a module of the same name
    from another file is replaced)."""
    try:
        found = path.is_file()
    except OSError as exc:  # a name no file may have (too long)
        raise PlanError(f"workload: {path} cannot be a file: {exc.strerror}") from None
    if not found:
        raise PlanError(f"workload: {path} is not a file")
    name = f"zerocc_workload_{path.stem}"
    cached = sys.modules.get(name)
    if cached is not None and _real(getattr(cached, "__file__", "")) == _real(str(path)):
        return cached
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PlanError(f"workload: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling look modules up by name)
    try:
        with workload_code(f"importing {path}", importing=True):
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)  # (not kept half run: imported again, it runs again)
        if isinstance(exc, ImportError):
            raise PlanError(f"workload: {path}: {exc}") from None
        raise
    return module


@contextlib.contextmanager
def workload_code(doing: str, *, importing: bool = False) -> Iterator[None]:
    """Where zerocc runs the workload's own code (``doing`` says what: importing or calling
    it, drawing its batches): an exception that code raises becomes a PlanError naming
    ``doing`` and the exception, with the traceback of the workload's frames (zerocc's calls
    down to it and importlib's left out), the exception as its cause. zerocc's errors pass as
    they are, and while ``importing`` an ImportError (the importer says where it searched)."""
    try:
        yield
    except ZeroccError:
        raise
    except Exception as exc:
        if importing and isinstance(exc, ImportError):
            raise
        # (the first two frames: this one's, and zerocc's that runs the workload's code in it)
        frames = traceback.extract_tb(exc.__traceback__)[2:]
        shown = [f for f in frames if not _importlib_frame(f.filename)]
        said = "".join(traceback.format_exception_only(exc)).strip()
        raise PlanError(
            f"workload: {doing} raised {said}\nTraceback of the workload's code (most recent "
            f"call last):\n{''.join(traceback.format_list(shown)).rstrip()}"
        ) from exc


def _importlib_frame(filename: str) -> bool:
    return filename.startswith("<frozen importlib") or filename == importlib.__file__


@contextlib.contextmanager
def _search_path(plan_dir: Path | None) -> Iterator[str]:
    """sys.path for the workload, restored after: the plan's folder first, then sys.path
    without the current directory ('' or its path: `python -m zerocc` puts it first) unless
    it is the plan's folder. Yields the search order as the error message says it."""
    cwd = _real(os.getcwd())
    installed = [p for p in sys.path if _real(p) != cwd]
    first = [str(plan_dir)] if plan_dir is not None else []
    saved = list(sys.path)
    sys.path[:] = first + installed
    if plan_dir is None:
        searched = "installed packages (sys.path) (a plan given as a dict has no folder)"
    else:
        searched = f"the plan's folder {plan_dir}, then installed packages (sys.path)"
    if plan_dir is None or _real(str(plan_dir)) != cwd:
        searched += "; not the current directory"
    try:
        yield searched
    finally:
        sys.path[:] = saved


def _real(path: str) -> str:
    """``path`` with links resolved ('' is the current directory, as on sys.path)."""
    return os.path.realpath(path or ".")


def _cwd_hint(module_name: str, plan_dir: Path | None) -> str:
    """A hint when the module sits in the current directory, which is not searched."""
    top = module_name.split(".")[0]
    if _module_file(Path.cwd(), top) is None or (plan_dir and _real(str(plan_dir)) == _real(".")):
        return ""
    return (
        f" ({Path.cwd()} holds {top!r}, but the current directory is not searched: put the "
        "module next to the plan, or install it)"
    )


def _module_file(folder: Path, top: str) -> Path | None:
    """The file a top-level module ``top`` would be imported from in ``folder``, if any."""
    for candidate in (folder / f"{top}.py", folder / top / "__init__.py"):
        try:
            if candidate.exists():
                return candidate
        except OSError:  # a name no file may have (too long): no such module there
            continue
    return None


def _forget(top: str) -> None:
    if top == __name__.split(".")[0]:  # zerocc's own workloads: zerocc is imported once
        return  # (its modules register torch ops, which cannot be registered twice)
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def _forget_if_found_elsewhere(module_name: str) -> None:
    """Drop a cached module that this search path would not import (another plan's module of
    the same name, or one the caller imported from the current directory), so that the
    import finds the plan's own, or fails as it would in a new process."""
    top = module_name.split(".")[0]
    cached_file = getattr(sys.modules.get(top), "__file__", None)
    if cached_file is None:
        return
    spec = importlib.machinery.PathFinder.find_spec(top, sys.path)
    found = spec.origin if spec is not None else None
    if found is None or _real(found) != _real(cached_file):
        _forget(top)
