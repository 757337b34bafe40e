"""The CPU's vector instruction set for Inductor's C++, found by checking only what is picked.

Inductor's C++ kernels are built for one vector ISA (AVX-512 with VNNI, AVX-512, AVX2, ...).
To pick it, torch checks *every* ISA the CPU advertises (``valid_vec_isa_list``): each check
compiles a probe with g++ and loads it in a fresh Python process, and the verdict is kept only
as the probe's file in ``TORCHINDUCTOR_CACHE_DIR``. On this 2-core CPU that was 6 probes:
14.5 s wall (8.4 s CPU of the compilers) of a cold first step, and on a warm cache still six
Python processes (~1.7 s). Yet torch picks the first of the list that passes (with neither
``ATEN_CPU_CAPABILITY`` nor ``cpp.simdlen`` set), so checking in the list's order and stopping
at the first that passes picks the same ISA: 3 probes (5.4 s wall, 3.6 s CPU, cold).
:func:`first_valid_isa_only` makes torch's list that one ISA while Inductor compiles; where
the user chose an ISA, or this torch lays the module out otherwise, it changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock


def _module() -> Any | None:
    """torch's ``cpu_vec_isa`` module, where it has what this shortcut reads; else None."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # pragma: no cover - an Inductor without C++ kernels
        return None
    needed = ("supported_vec_isa_list", "x86_isa_checker", "valid_vec_isa_list")
    return cpu_vec_isa if all(hasattr(cpu_vec_isa, n) for n in needed) else None


def shortcut_applies() -> bool:
    """Whether torch would pick the first valid ISA of its list: an x86-64 CPU on Linux or
    Windows, no ISA chosen by ``ATEN_CPU_CAPABILITY`` or ``cpp.simdlen``, not fbcode, and the
    list not found yet (once found, torch's own answer costs nothing)."""
    import platform
    import sys

    from torch._inductor import config

    module = _module()
    if module is None or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if sys.platform not in ("linux", "win32"):  # (torch's list is empty elsewhere)
        return False
    if os.environ.get("ATEN_CPU_CAPABILITY") or config.cpp.simdlen is not None:
        return False
    if config.is_fbcode():
        return False
    found = getattr(module.valid_vec_isa_list, "cache_info", None)
    return found is None or found().currsize == 0


@functools.cache
def first_valid_isa() -> list[Any]:
    """The first ISA of torch's list, in its order, that this CPU advertises and that builds
    and loads (torch's own check, ``bool(isa)``), as a list of one (empty: none did)."""
    module = _module()
    advertised = module.x86_isa_checker()
    for isa in module.supported_vec_isa_list:
        if all(flag in advertised for flag in str(isa).split()) and isa:
            return [isa]
    return []


@contextlib.contextmanager
def first_valid_isa_only() -> Iterator[None]:
    """In the body, torch's valid ISA list is :func:`first_valid_isa` where that is the ISA
    it would pick (:func:`shortcut_applies`); else unchanged."""
    if not shortcut_applies():
        yield
        return
    module = _module()
    with mock.patch.object(module, "valid_vec_isa_list", first_valid_isa):
        yield
