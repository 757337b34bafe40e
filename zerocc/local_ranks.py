"""Where a rank sits on its machine, as its launcher says (torchrun's ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``): read here once for every part that shares out a machine's GPUs, cores,
memory or disk among its ranks."""

from __future__ import annotations

import os

from zerocc.errors import ZeroccError


def local_rank() -> int:
    """This rank's index on its machine (``LOCAL_RANK``; 0 where no launcher set it)."""
    return _read("LOCAL_RANK", 0, least=0)


def ranks_on_this_machine(unknown: int) -> int:
    """How many ranks share this machine (``LOCAL_WORLD_SIZE``); ``unknown`` where no launcher
    said (a process started otherwise: each caller names what it assumes then). Never fewer
    than this rank's index says are there."""
    return max(_read("LOCAL_WORLD_SIZE", unknown, least=1), local_rank() + 1)


def _read(name: str, default: int, least: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) < least:
        raise ZeroccError(
            f"{name}={value!r}: a whole number of at least {least}, as torchrun sets it"
        )
    return int(value)
