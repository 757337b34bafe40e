"""The CPU's vector instruction set for Inductor's C++, found by checking only what is picked.

Inductor's C++ kernels are built for one vector ISA (AVX-512 with VNNI, AVX-512, AVX2, ...).
To pick it, torch checks *every* ISA the CPU advertises (``valid_vec_isa_list``): each check
compiles a probe with g++ and loads it in a fresh Python process, and the verdict is kept only
as the probe's file in ``TORCHINDUCTOR_CACHE_DIR``. On this 2-core CPU that was 6 probes:
14.5 s wall (8.4 s CPU of the compilers) of a cold first step, and on a warm cache still six
Python processes (~1.7 s). Yet torch picks the first of the list that passes (with neither
``ATEN_CPU_CAPABILITY`` nor ``cpp.simdlen`` set), so checking in the list's order and stopping
at the first that passes picks the same ISA: 3 probes (5.4 s wall, 3.6 s CPU, cold).
The verdict (which ISA passed, and whether AVX-512 BF16 built with it) is kept in
``TORCHINDUCTOR_CACHE_DIR/zerocc/vec_isa-<key>.json``, the key the CPU's advertised flags, the
C++ compiler's version, torch's version and torch's list: a warm launch reads it instead of
loading the probes again in three Python processes (~0.8 s). :func:`first_valid_isa_only`
makes torch's list that one ISA while Inductor compiles; where the user chose an ISA, or this
torch lays the module out otherwise, it changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
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
    and loads (torch's own check, ``bool(isa)``), as a list of one (empty: none did); read
    from :func:`verdict_path` where an earlier launch found it."""
    module = _module()
    advertised = module.x86_isa_checker()
    path = verdict_path(advertised)
    cached = _read_verdict(path)
    if cached is not None:
        for isa in module.supported_vec_isa_list:
            if str(isa) == cached["isa"]:
                _known_valid(isa, bool(cached["bf16"]))
                return [isa]
        if cached["isa"] is None:
            return []
    found = next(  # the first that passes: the next ones are not probed
        (
            [isa]
            for isa in module.supported_vec_isa_list
            if all(flag in advertised for flag in str(isa).split()) and isa
        ),
        [],
    )
    _write_verdict(path, found)
    return found


def _known_valid(isa: Any, bf16: bool) -> None:
    """Let torch's own ``bool(isa)`` (cached per ISA; Inductor's code generation asks it
    again) find the kept verdict: evaluated once with every check passing but BF16's, which
    says ``bf16``, so it sets what its probes would have set and runs none."""
    bf16_code = getattr(isa, "_avx512_bf16_code", None)

    def check_build(self: Any, code: str) -> bool:
        return bf16 if code == bf16_code else True

    with mock.patch.object(type(isa), "check_build", check_build):
        bool(isa)


def verdict_path(advertised: list[str]) -> str:
    """Where the verdict of this CPU, compiler and torch is kept (see the module's text)."""
    import torch
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    module = _module()
    key = json.dumps(
        [
            sorted(advertised),
            get_compiler_version_info(get_cpp_compiler()),
            torch.__version__,
            [str(isa) for isa in module.supported_vec_isa_list],
            bool(torch.cpu._is_avx512_bf16_supported()),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), "zerocc", f"vec_isa-{digest}.json")


def _read_verdict(path: str) -> dict | None:
    """The kept verdict, None where there is none or it is unreadable (probed anew)."""
    try:
        with open(path) as f:
            verdict = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(verdict, dict) or set(verdict) != {"isa", "bf16"}:
        return None
    return verdict


def _write_verdict(path: str, found: list[Any]) -> None:
    """Keep the verdict (written whole, then renamed: a reader sees all of it or none)."""
    isa = found[0] if found else None
    verdict = {
        "isa": None if isa is None else str(isa),
        "bf16": bool(getattr(isa, "_is_avx512_bf16_supported", False)),
    }
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump(verdict, f)
        os.replace(partial, path)
    except OSError:  # a cache that cannot be written costs the probes next time, no more
        pass


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
