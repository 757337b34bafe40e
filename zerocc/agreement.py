"""Ranks agree before they act: on the next micro-batch (its shapes and dtypes, or that there
is none left) and on every new program, so that a difference is an error on every rank, naming
each rank's view, and never a hang or a silent divergence.

An agreement all-gathers an 8-byte hash of what each rank is about to do; only when the hashes
differ does it gather the full views, to say where they differ.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from zerocc.comm import Comm, TorchComm
from zerocc.errors import DataExhaustedError, RankMismatchError, ZeroccError

END_OF_DATA = ("end of data",)  # what a rank with no batch left agrees on


def digest(text: str) -> str:
    """A hash of ``text`` (hex), the same on every rank."""
    return hashlib.sha256(text.encode()).hexdigest()


def views_if_they_differ(comm: Comm, what: tuple, detail: str) -> list[Any] | None:
    """None when every rank of ``comm`` has the same ``what``; else every rank's ``detail``, by
    rank. A collective that fails (a peer that stopped answering, or left) is recorded on
    ``comm.failure`` and re-raised."""
    if not isinstance(comm, TorchComm) or comm.world_size == 1:
        return None
    mine = torch.tensor([int(digest(repr(what))[:15], 16)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(comm.world_size)]
    views: list[Any] = [None] * comm.world_size
    try:
        dist.all_gather(everyone, mine, group=comm.control_group)
        if all(torch.equal(t, mine) for t in everyone):
            return None
        dist.all_gather_object(views, detail, group=comm.control_group)
    except Exception as exc:
        comm.failure = exc
        raise
    return views


def batch_disagreement(views: list[Any], rank: int, step: int) -> ZeroccError:
    """The error of ranks that disagree on the next micro-batch: some have none left
    (DataExhaustedError), or their batches' shapes differ (RankMismatchError)."""
    ended = [r for r, v in enumerate(views) if v == repr(END_OF_DATA)]
    if ended:
        going = [r for r in range(len(views)) if r not in ended]
        return DataExhaustedError(
            f"rank {rank}, step {step}: rank(s) {_ranks(ended)} ran out of batches while "
            f"rank(s) {_ranks(going)} still had one. Every rank must train on the same number "
            "of batches (as under DDP): split the data evenly across ranks (drop the "
            "remainder), or stop every rank at the same step"
        )
    return RankMismatchError(
        f"rank {rank}, step {step}: the batch shapes differ across ranks: "
        + first_difference(views)
    )


def first_difference(views: list[Any]) -> str:
    """Name the first line where ranks' texts differ, with each rank's version of it."""
    lines = [str(v).splitlines() for v in views]
    for i in range(max(len(x) for x in lines)):
        at = [x[i] if i < len(x) else "<end>" for x in lines]
        if len(set(at)) > 1:
            return f"first difference at line {i + 1}: " + "; ".join(
                f"rank {r}: {text.strip()}" for r, text in enumerate(at)
            )
    return "texts differ"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
