"""Backends: turn a scheduled program into an executable bound to a runtime context.

A backend is ``compile(program, example_inputs, ctx) -> Executable``: ``program`` is the
scheduled ``fx.GraphModule`` (zerocc's ops in it have schemas and fake implementations only,
:mod:`zerocc.ir.ops`), ``example_inputs`` the fake values of its placeholders, ``ctx`` the
:class:`~zerocc.engine.RuntimeContext` (process group, copy engine, kernel set,
device). The executable owns its runtime state (what is in flight); interpreting its ``gm``
node by node runs the same computation (profiling, calibration and dumps do). ``eager`` is the
reference; another backend registers itself with :func:`register_backend` and is chosen by a
plan's ``backend.name``. ``auto`` is no backend of its own: :func:`resolve_backend` makes it
``inductor`` on a GPU and ``eager`` on a CPU, as measured (BENCHMARKS.md). ``inductor`` compiles
each distinct compute region once (a repeated layer's copies share one), ``inductor-whole`` the
whole program as one graph; ``inductor-regions`` is ``inductor``'s name before it was the
default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import fx

from zerocc.backends import eager, inductor
from zerocc.engine import RuntimeContext
from zerocc.errors import PlanError


class Executable(Protocol):
    """A program bound to a runtime context."""

    gm: fx.GraphModule  # what runs; interpretable node by node, nodes tagged as the program's

    def __call__(self, *args: Any) -> Any: ...

    def in_flight(self) -> int:
        """Collectives and copies issued and not yet waited on."""
        ...

    def reset(self) -> None:
        """Forget what a failed run left in flight."""
        ...

    def lowering(self) -> str:
        """How the program was lowered, in one line without timings: the same on ranks that
        lowered it alike (the ranks compare it before the first run)."""
        ...

    def notes(self) -> list[str]:
        """Lines for ``explain()``: what the backend made of the program (regions compiled,
        those it left eager and why); none for a backend with nothing to say."""
        ...

    def artifacts(self) -> dict[str, str]:
        """Files for the dumps, by name: what the backend generated (code, a table of its
        regions); none for a backend that generates nothing."""
        ...


Backend = Callable[[fx.GraphModule, Sequence[Any], RuntimeContext], Executable]
BACKENDS: dict[str, Backend] = {
    "eager": eager.compile,
    "inductor": inductor.compile,  # per region, once per repeated layer
    "inductor-regions": inductor.compile,  # (its name before it was inductor's form)
    "inductor-whole": inductor.compile_whole,
}
AUTO = "auto"


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend ``backend.name: name`` runs on ``device``; any name but ``auto`` is itself.
    ``auto`` picks what was measured: on a GPU ``inductor`` (by region), whose Triton kernels took
    0.94× the eager backend's step (355M GPT, world size 1, one H100), as fast as the whole
    graph (86.1 against 86.6 ms), which took 76 s to compile cold (the regions 33 s, after it:
    some of its kernels cached). At world size 1 no collective splits the compute, so both
    compile one graph of it; what the whole graph adds, fusing across units, needs two GPUs
    or more: not measured yet. On a CPU ``eager``, where Inductor's C++ took 0.96-1.02× of it,
    whole or by region, within the noise, for a first compile of half a minute."""
    if name != AUTO:
        return name
    return "inductor" if device.type == "cuda" else "eager"


def register_backend(name: str, backend: Backend) -> None:
    """Make ``backend`` the one a plan's ``backend.name: <name>`` runs on. A name already
    registered is an error: replacing a backend (``eager`` among them) would change what every
    plan naming it runs, unseen."""
    if name in BACKENDS or name == AUTO:
        raise ValueError(f"backend {name!r} is already registered; register under another name")
    BACKENDS[name] = backend


def get_backend(name: str, device: torch.device | None = None) -> Backend:
    """The backend a plan names (``auto`` resolved for ``device``; without one, any backend
    ``auto`` may pick); a PlanError listing the registered ones for any other name."""
    if name == AUTO:
        name = resolve_backend(name, device or torch.device("cpu"))
    if name not in BACKENDS:
        raise PlanError(
            f"backend.name: {name!r} is not a registered backend; registered: "
            f"{', '.join(sorted(BACKENDS))}, or auto"
        )
    return BACKENDS[name]
