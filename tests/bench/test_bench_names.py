"""bench/'s scripts import each other by plain name (``python bench/X.py`` puts bench/ first on
``sys.path``), so none may take the name of a module installed beside zerocc or of the standard
library: theirs would be shadowed by ours in every bench run (bench/kernels.py once hid Hugging
Face's ``kernels``, and transformers 5 failed to import under it)."""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder

from bench_runs import BENCH


def test_no_bench_module_shadows_an_installed_or_standard_one():
    elsewhere = [p for p in sys.path if p and p != str(BENCH)]
    names = sorted(f.stem for f in BENCH.glob("*.py"))
    assert "compare" in names and "config" in names  # (the glob found the scripts)
    shadowed = {
        name: str(spec.origin)
        for name in names
        if (spec := PathFinder.find_spec(name, elsewhere)) is not None
    }
    assert shadowed == {}, f"bench/ modules named as installed ones: {shadowed}"
    assert not set(names) & sys.stdlib_module_names
