"""docs/layout.md names every module of the package, in its package's entry, and names no
module that is not there (issue 78: it placed pipeline_step.py in runtime/, where no such file
was, and named none of a dozen modules added since). An entry starts with its folder:
``zerocc/x/`` from the top, or ``name/`` indented two spaces under its parent's entry."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
TEXT_COLUMN = 19  # where an entry's text starts; a folder starts an entry left of it
NAMED_FILE = re.compile(r"(?<![\w/.])([A-Za-z_]\w*\.(?:py|sh))\b")


@dataclass
class Entry:
    folder: Path  # relative to the repository
    text: str
    line: int


def entries(layout: str) -> list[Entry]:
    """The entries of the page's layout block, in order."""
    before, block = layout.split("```\n", 2)[:2]
    found: list[Entry] = []
    parents: list[Path] = []
    for number, line in enumerate(block.splitlines(), start=before.count("\n") + 2):
        start = re.match(r"^( *)(\S+/)(\s|$)", line)
        if start and len(start[1]) < TEXT_COLUMN:
            depth = len(start[1]) // 2
            assert len(start[1]) % 2 == 0 and depth <= len(parents), (
                f"docs/layout.md:{number}: {start[2]} is indented {len(start[1])} spaces: an "
                "entry under another is indented two spaces more than its parent's"
            )
            parent = parents[depth - 1] if depth else Path()
            parents[depth:] = [parent / start[2].rstrip("/")]
            found.append(Entry(parents[depth], line[len(start[0]) :], number))
        elif found:
            found[-1].text += " " + line.strip()
    return found


def package_modules() -> dict[Path, set[str]]:
    """Each package folder of zerocc/ and the file names of its modules (``__init__.py``
    aside: the package's entry is its own)."""
    out: dict[Path, set[str]] = {}
    for init in (ROOT / "zerocc").rglob("__init__.py"):
        folder = init.parent
        out[folder.relative_to(ROOT)] = {
            p.name for p in folder.glob("*.py") if p.name != "__init__.py"
        }
    return out


@pytest.fixture(scope="module")
def layout() -> list[Entry]:
    return entries(LAYOUT.read_text())


def test_every_package_has_an_entry(layout):
    listed = {e.folder for e in layout}
    missing = sorted(str(f) + "/" for f in package_modules() if f not in listed)
    assert not missing, (
        f"docs/layout.md has no entry for {missing}: add a line for each, `name/` indented "
        "two spaces under its parent's entry (or `zerocc/name/` at the top), saying what it holds"
    )


def test_every_module_is_named_in_its_packages_entry(layout):
    named: dict[Path, set[str]] = {}
    for entry in layout:
        named.setdefault(entry.folder, set()).update(NAMED_FILE.findall(entry.text))
    unnamed = [
        f"{folder}/{name}"
        for folder, modules in sorted(package_modules().items())
        for name in sorted(modules - named.get(folder, set()))
    ]
    assert not unnamed, (
        f"docs/layout.md does not name {unnamed}: name each (`name.py`, with what it does) in "
        "its package's entry (`zerocc/x/` at the top, `x/` indented under its parent)"
    )


def test_every_module_it_names_is_there(layout):
    gone = [
        f"{entry.folder}/{name} (its entry at docs/layout.md:{entry.line})"
        for entry in layout
        for name in NAMED_FILE.findall(entry.text)
        if not (ROOT / entry.folder / name).is_file()
    ]
    gone += [
        f"{entry.folder}/ (docs/layout.md:{entry.line})"
        for entry in layout
        if not (ROOT / entry.folder).is_dir()
    ]
    assert not gone, (
        f"docs/layout.md names {gone}, which are not there: remove each from its entry, or "
        "name the module where its code went"
    )


def test_the_checks_read_an_entry_and_its_children():
    page = "intro\n```\nzerocc/a/          one.py and\n                   two.py\n  b/" \
           "               three.py\nbench/             run.sh\n```\n"  # fmt: skip
    parsed = [(str(e.folder), NAMED_FILE.findall(e.text)) for e in entries(page)]
    assert parsed == [
        ("zerocc/a", ["one.py", "two.py"]),
        ("zerocc/a/b", ["three.py"]),
        ("bench", ["run.sh"]),
    ]
