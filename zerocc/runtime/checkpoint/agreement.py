"""Ranks agreeing on the outcome of a checkpoint step: each rank tries, every rank learns every
rank's error, and all of them raise the same error when any failed, so no rank goes on (or
waits in a collective) while another has given up."""

from __future__ import annotations

from collections.abc import Callable

from zerocc.engine.comm import Comm
from zerocc.engine.failures import first_line, peer_failure
from zerocc.errors import CheckpointError


def attempt(action: Callable[[], object]) -> str | None:
    """Run ``action``; its error as one line, or None."""
    try:
        action()
    except Exception as exc:  # reported to every rank, raised on all of them
        return f"{type(exc).__name__}: {first_line(exc)}"
    return None


def raise_errors(errors: dict[int, str], what: str, outcome: str) -> None:
    """Raise the ranks' ``errors`` (by rank) as one CheckpointError naming each; nothing when
    there are none."""
    if not errors:
        return
    lines = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(errors.items()))
    raise CheckpointError(f"checkpoint {what} failed ({lines}); {outcome}")


def gathered(comm: Comm, value: object, what: str) -> list:
    """Every rank's ``value``, by rank; a peer that left or stopped answering meanwhile (killed
    mid-save) is a RankStoppedError naming it, not the process group's own message."""
    try:
        return comm.all_gather_object(value)
    except Exception as exc:
        raise peer_failure(comm, exc, f"the checkpoint's {what}") from exc


def agree(comm: Comm, error: str | None, what: str, outcome: str) -> None:
    """Every rank learns every rank's ``error``; all raise when any failed. The same error on
    every rank (a checkpoint of another model, say) is raised as that error alone."""
    errors = {r: e for r, e in enumerate(gathered(comm, error, what)) if e is not None}
    alike = set(errors.values())
    if len(errors) == comm.world_size and len(alike) == 1:
        raise CheckpointError(alike.pop().removeprefix("CheckpointError: "))
    raise_errors(errors, what, outcome)
