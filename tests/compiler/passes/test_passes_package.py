"""The passes package's layout says which module is which (zerocc/compiler/passes/__init__.py):
a module directly in ``passes/`` is a registered pass (or ``spec``, what a pass is); the helpers
passes call, which register nothing, are in ``passes/support/``."""

from __future__ import annotations

from pathlib import Path

import zerocc.compiler.passes
from zerocc.compiler.passes.spec import PASSES

PACKAGE = Path(zerocc.compiler.passes.__file__).parent
NOT_PASSES = {"__init__", "spec"}


def registering_modules() -> set[str]:
    """The modules whose functions are registered passes, by dotted name."""
    return {spec.fn.__module__ for spec in PASSES.values()}


def test_every_module_directly_in_passes_registers_a_pass():
    registering = registering_modules()
    helpers = sorted(
        path.name
        for path in PACKAGE.glob("*.py")
        if path.stem not in NOT_PASSES and f"zerocc.compiler.passes.{path.stem}" not in registering
    )
    assert not helpers, (
        f"{helpers} in zerocc/compiler/passes/ register no pass: a helper that passes call "
        "belongs in zerocc/compiler/passes/support/ (and its line in that package's docstring)"
    )


def test_no_helper_registers_a_pass():
    misplaced = sorted(m for m in registering_modules() if m.startswith(
        "zerocc.compiler.passes.support"))
    assert not misplaced, f"{misplaced} register passes: a pass sits directly in passes/"


def test_the_support_docstring_names_every_helper():
    support = PACKAGE / "support"
    doc = zerocc.compiler.passes.support.__doc__ or ""
    unnamed = sorted(
        p.stem for p in support.glob("*.py") if p.stem != "__init__" and f"``{p.stem}``" not in doc
    )
    assert not unnamed, f"zerocc/compiler/passes/support/__init__.py does not say what {unnamed} do"
