"""The user docs (README.md, docs/*.md but the design notes, which record why and when):
they speak of zerocc, not of its tracker's issue numbers, which mean nothing to a reader."""

from __future__ import annotations

import re
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
