"""The README's "first ten minutes" runs as written and prints the figures it quotes: each
```bash block of that section is run in order, in one folder (the examples beside it, so that
what one block saves the next reads), and every ``# prints:`` line of a block must appear in what
its commands printed. A figure that drifts (a loss, a byte count, a memory estimate) fails here,
and the README is regenerated from the command it names."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## The first ten minutes"
PRINTS = "# prints: "


def blocks(readme: str) -> list[tuple[list[str], list[str]]]:
    """(commands, expected lines) of each bash block of the section."""
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found = []
    for body in re.findall(r"```bash\n(.*?)```", section, re.S):
        lines = body.strip().splitlines()
        commands = [line for line in lines if line and not line.startswith("#")]
        expected = [line.removeprefix(PRINTS) for line in lines if line.startswith(PRINTS)]
        found.append((commands, expected))
    return found


def test_the_section_has_commands_and_figures():
    found = blocks((ROOT / "README.md").read_text())
    assert len(found) >= 5 and all(commands and expected for commands, expected in found)


def test_the_first_ten_minutes_print_what_the_readme_says(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for commands, expected in blocks((ROOT / "README.md").read_text()):
        printed = ""
        for command in commands:
            argv = shlex.split(command)
            assert argv[0] == "zerocc", command  # (run by this interpreter's zerocc)
            run = subprocess.run(
                [sys.executable, "-m", "zerocc", *argv[1:]],
                cwd=tmp_path, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert run.returncode == 0, f"{command}:\n{run.stdout}\n{run.stderr}"
            printed += run.stdout + run.stderr
        for line in expected:
            if line not in printed:
                pytest.fail(f"the README says {commands} print {line!r}; they printed:\n{printed}")
