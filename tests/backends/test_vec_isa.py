"""Inductor's vector ISA found by checking only the one picked
(zerocc/backends/inductor/vec_isa.py): the same ISA as torch's full check, with fewer probes
(each a g++ build and a Python process)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from unittest import mock

import pytest

from zerocc.backends.inductor import vec_isa

cpu_vec_isa = pytest.importorskip("torch._inductor.cpu_vec_isa")
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64"
    or sys.platform != "linux"
    or "ATEN_CPU_CAPABILITY" in os.environ,
    reason="the shortcut applies on x86-64 Linux with no ISA chosen",
)


def _forget() -> None:
    """Every verdict torch and zerocc keep in this process (each ISA's, the list's)."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    vec_isa.first_valid_isa.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        for cls in type(isa).__mro__:
            for attribute in vars(cls).values():
                if hasattr(attribute, "cache_clear"):
                    attribute.cache_clear()


@pytest.fixture
def probes() -> Iterator[list[str]]:
    """The ISA checks run (each passing, no compiler called), with nothing known before or
    kept after."""
    checked: list[str] = []

    def check_build(self, code: str) -> bool:
        checked.append(str(self))
        return True

    _forget()
    with mock.patch.object(cpu_vec_isa.VecISA, "check_build", check_build):
        yield checked
    _forget()


def test_the_first_valid_isa_is_the_one_torch_picks_with_fewer_probes(probes):
    """torch's pick checks every ISA the CPU advertises (6 probes on an AVX-512 VNNI CPU: the
    VNNI one's three, AVX-512's two again, AVX2's); the shortcut stops at the first."""
    picked = cpu_vec_isa.pick_vec_isa()
    every = len(probes)
    _forget()
    probes.clear()
    with vec_isa.first_valid_isa_only():
        assert cpu_vec_isa.pick_vec_isa() is picked
    advertised = cpu_vec_isa.x86_isa_checker()
    candidates = [
        i
        for i in cpu_vec_isa.supported_vec_isa_list
        if all(f in advertised for f in str(i).split())
    ]
    assert set(probes) == {str(picked)}, probes
    if len(candidates) > 1:
        assert len(probes) < every, (probes, every)


def test_a_chosen_isa_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not vec_isa.shortcut_applies()
    real = cpu_vec_isa.valid_vec_isa_list
    with vec_isa.first_valid_isa_only():
        assert cpu_vec_isa.valid_vec_isa_list is real
