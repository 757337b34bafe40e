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
def probes(monkeypatch, tmp_path) -> Iterator[list[str]]:
    """The ISA checks run (each passing, no compiler called), with nothing known before or
    kept after (the verdicts kept in a cache folder of the test's own)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
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


def _launch() -> object:
    """The ISA picked as a fresh launch would (nothing known in the process)."""
    _forget()
    with vec_isa.first_valid_isa_only():
        return cpu_vec_isa.pick_vec_isa()


def test_a_second_launch_reads_the_verdict_instead_of_probing(probes):
    """The verdict is kept in the Inductor cache folder: a second launch with the same CPU,
    compiler and torch runs no probe and picks the same ISA, with the same BF16 verdict."""
    first = _launch()
    assert set(probes) == {str(first)}, probes  # (its checks: the ISA's, BF16's, VNNI's)
    bf16 = getattr(first, "_is_avx512_bf16_supported", None)
    if bf16 is not None:
        first._is_avx512_bf16_supported = not bf16  # what a fresh process would not know
    probes.clear()
    second = _launch()
    assert probes == []
    assert str(second) == str(first)
    assert getattr(second, "_is_avx512_bf16_supported", None) == bf16
    assert second and probes == []  # torch's own check (code generation asks it) is known


def test_another_compiler_or_a_spoilt_verdict_probes_again(probes, monkeypatch):
    first = _launch()
    path = vec_isa.verdict_path(cpu_vec_isa.x86_isa_checker())
    assert os.path.isfile(path)
    with open(path, "w") as f:
        f.write("{not json")
    probes.clear()
    assert str(_launch()) == str(first) and set(probes) == {str(first)}
    from torch._inductor import cpp_builder

    monkeypatch.setattr(cpp_builder, "get_compiler_version_info", lambda compiler: "g++ 99")
    probes.clear()
    assert str(_launch()) == str(first) and set(probes) == {str(first)}
    assert vec_isa.verdict_path(cpu_vec_isa.x86_isa_checker()) != path
