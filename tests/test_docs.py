"""The user docs (README.md, docs/*.md but the design notes, which record why and when):
they speak of zerocc, not of its tracker's issue numbers, which mean nothing to a reader; and
the outputs docs/inspect.md shows are what zerocc prints (as tests/test_readme.py holds the
README's), but for times, which are the machine's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tracked import tracked

ROOT = Path(__file__).resolve().parent.parent
DEVELOPER_DOCS = {"design-notes.md"}


def user_docs() -> list[Path]:
    return [ROOT / "README.md"] + [
        p for p in tracked(ROOT / "docs", "*.md") if p.name not in DEVELOPER_DOCS
    ]


def test_user_docs_name_no_tracker_issue():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in user_docs()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissues? #?\d+", line, re.I)
    ]
    assert len(user_docs()) >= 10 and not found, "\n".join(found)


def shown(doc: str, command: str) -> list[str]:
    """The lines a code block of ``doc`` shows ``$ command`` printing (up to the block's end)."""
    text = (ROOT / "docs" / doc).read_text()
    block = text.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def zerocc(*argv: str) -> str:
    run = subprocess.run([sys.executable, "-m", "zerocc", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_inspect_md_shows_the_pass_table_zerocc_prints():
    """docs/inspect.md's pass table: each pass's node count, nodes added and the first ops it
    inserted as `zerocc inspect` prints them (its times are this machine's; its op lists cut
    with '...'). Its counts had drifted (shard 730 nodes, +199, where zerocc made 720, +189)."""
    command = "zerocc inspect examples/gpt/zero3.yaml"
    rows = {line.split()[0]: line for line in zerocc(*command.split()[1:]).splitlines()[2:]}
    lines = shown("inspect.md", command)
    assert lines[0].split() == ["pass", "ms", "nodes", "added", "removed", "ops", "inserted"]
    for line in lines[1:]:
        name, _ms, counts = line.split(None, 2)
        shown_counts = " ".join(counts.split()).removesuffix("...").rstrip(", ")
        printed = " ".join(rows[name].split(None, 2)[2].split())
        assert printed.startswith(shown_counts), (line, rows[name])


def test_inspect_md_shows_the_estimate_table_zerocc_prints():
    """docs/inspect.md's table of the 7B example's stages: every row it shows, as printed."""
    command = "zerocc estimate examples/gpt/7b.yaml --world-size 64 --table"
    printed = zerocc(*command.split()[1:]).splitlines()
    for line in shown("inspect.md", command):
        assert line == "..." or line in printed, line


def test_parallelism_md_shows_the_70b_estimate_zerocc_prints():
    """docs/parallelism.md's bytes per collective of the 70B tp example, as printed (its mesh
    line cut with '...')."""
    command = "zerocc estimate examples/gpt/70b-tp.yaml --world-size 1024"
    text = (ROOT / "docs" / "parallelism.md").read_text()
    block = text.split(command, 1)[1].split("\n", 1)[1].split("```", 1)[0]
    printed = zerocc(*command.split()[1:]).splitlines()
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 5
    for line in lines:
        cut = line.removesuffix("...").rstrip("; ")
        assert any(p.startswith(cut) for p in printed), line
