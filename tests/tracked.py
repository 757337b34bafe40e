"""The repository's files as git tracks them: tests that walk the examples or docs read these,
not whatever a user's own commands left beside them (`zerocc plan auto examples/gpt/zero3.yaml`
writes examples/gpt/zero3.auto.yaml)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tracked(folder: Path, pattern: str) -> list[Path]:
    """The files git tracks in ``folder`` (not below it unless ``pattern`` says ``**/``)
    matching ``pattern``, sorted; outside a git checkout (an unpacked release), the files
    found there."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", str(folder)], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return sorted(folder.glob(pattern))
    files = {ROOT / name for name in listed.split("\0") if name}
    return sorted(path for path in folder.glob(pattern) if path in files)
