"""The folder a run saves its checkpoints to holds that run's checkpoints only.

A run that saves into a folder of checkpoints it does not go on from would mix two runs in
one folder: ``keep`` deleting by step could delete the new run's save (the other run's are
later), ``latest`` would name the one it deleted, and a ``--resume`` of the folder would load
the other run's. So before a run starts, the folder it saves to may hold checkpoints only up
to the one it resumes from, in that same folder: any other (another run's, or later than the
one resumed) is refused by name, unless the run was told to replace them
(``zerocc train --overwrite``), which deletes them first and says which.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from zerocc.runtime.checkpoint.files import (
    LATEST,
    PREFIX,
    CheckpointError,
    resolve,
    saved_checkpoints,
    write_atomically,
)


@dataclass(frozen=True)
class Mixed:
    """What a save folder holds that a run saving there would mix with its own: ``stale``
    checkpoints (oldest first), and the checkpoint it resumes from there (None when it
    resumes from none in that folder)."""

    root: Path
    stale: list[Path]
    resumed: Path | None

    def said(self) -> str:
        """The stale checkpoints in a few words: their names (the first and last of many)."""
        names = [p.name for p in self.stale]
        if len(names) > 4:
            return f"{len(names)} checkpoints, {names[0]} to {names[-1]}"
        return ", ".join(names)


def mixed_checkpoints(root: str | Path | None, resume: str | Path | None) -> Mixed | None:
    """The checkpoints of the save folder ``root`` that are not the run's own: all of them
    when the run resumes from none there (``resume``: the checkpoint, or folder of them, it
    starts from), else those later than the one it resumes from; None when there are none."""
    if root is None or not Path(root).is_dir():
        return None
    root = Path(root)
    found = saved_checkpoints(root)
    if not found:
        return None
    resumed = resolve(resume) if resume is not None else None
    if resumed is not None and resumed.resolve().parent == root.resolve():
        stale = [p for p in found if p.name > resumed.name]
        return Mixed(root, stale, resumed) if stale else None
    return Mixed(root, found, None)


def refusal(mixed: Mixed, named_by: str) -> CheckpointError:
    """The error of a run that would save into ``mixed.root`` among ``mixed.stale`` (the
    folder named by ``named_by``: ``--save`` or ``checkpoint.dir``)."""
    where = f"{named_by} {mixed.root}"
    if mixed.resumed is None:
        return CheckpointError(
            f"{where} holds checkpoints of another run ({mixed.said()}): this run's saves "
            f"would mix with them. Go on from them with --resume {mixed.root}, replace them "
            "with --overwrite, or save to another folder"
        )
    return CheckpointError(
        f"{where} holds {mixed.said()}, later than {mixed.resumed.name} this run resumes "
        f"from: its saves would mix with them. Resume from the newest with "
        f"--resume {mixed.root}, replace them with --overwrite, or save to another folder"
    )


def replace_checkpoints(mixed: Mixed) -> None:
    """Delete ``mixed.stale`` (``--overwrite``) and the saves of the folder that did not
    finish; ``latest`` then names the checkpoint the run resumes from there, else none is left
    (the run's first save writes it)."""
    for folder in mixed.stale:
        shutil.rmtree(folder)
    for pattern in (f".{PREFIX}*.partial", f".{PREFIX}*.old"):
        for unfinished in mixed.root.glob(pattern):
            shutil.rmtree(unfinished, ignore_errors=True)
    if mixed.resumed is not None:
        write_atomically(mixed.root / LATEST, mixed.resumed.name + "\n")
    else:
        (mixed.root / LATEST).unlink(missing_ok=True)
