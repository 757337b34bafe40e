"""What a rank's failures become: a peer that stopped answering, a process group that failed, a
program run that raised.

:class:`RankHealth` is this rank among its peers: the status its heartbeat tells them, whether
its process group can still run anything, the meeting points where ranks wait for each other
while they compile, and the error a peer's failure is here. :func:`run_failure` is the error
a program run that raised becomes (the step rolled back to its accumulation window's start
where the run may go on). :func:`gathered` is what the ranks tell each other between steps (the
metrics, the agreement to stop) on the same path: a peer gone is named, not gloo's message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from zerocc.engine.comm import Comm
from zerocc.engine.failures import (
    describe_node,
    failing_node,
    first_line,
    peer_failure,
    signature_difference,
)
from zerocc.errors import BatchError, OffloadError, RankStoppedError
from zerocc.ir.nodes import info
from zerocc.runtime.counts import StepCounts


class RankHealth:
    """This rank's standing among its peers on ``comm``: ``counts`` say which optimizer step
    the next micro-batch belongs to (errors name it); ``timeout_s``: how long a silent peer is
    waited for (``backend.timeout_s``)."""

    def __init__(self, comm: Comm, timeout_s: float, counts: StepCounts) -> None:
        self.comm, self.timeout_s, self.counts = comm, timeout_s, counts

    def step_number(self) -> int:
        """The 1-based number of the optimizer step the next micro-batch belongs to."""
        return self.counts.step_number

    def set_status(self, status: str) -> None:
        """What this rank is doing, as its heartbeat tells the others (an attribute write)."""
        if self.comm.heartbeat is not None:
            self.comm.heartbeat.status = status

    def check_usable(self) -> None:
        """Raise RankStoppedError once the process group failed: nothing more can run on it."""
        if self.comm.failure is not None:
            raise RankStoppedError(
                f"rank {self.comm.rank}: this training step cannot go on: its process group "
                f"failed ({first_line(self.comm.failure)}); start the ranks again and load "
                "the last checkpoint"
            )

    def peer_failure(self, exc: BaseException, where: str) -> RankStoppedError:
        """The error of a collective that failed (``exc``, in ``where``): who stopped
        answering, as the heartbeats tell; the process group is closed."""
        return peer_failure(self.comm, exc, where, self.step_number(), self.timeout_s)

    def gathered(self, value: Any, where: str) -> list[Any]:
        """Every rank's ``value``, by rank, for what the ranks tell each other outside the
        step (the metrics, the agreement to stop): see :func:`gathered`."""
        return gathered(self.comm, value, where, self)

    def wait_for_ranks(self, tag: str, doing: str) -> None:
        """Return once every rank got here: compiling takes what it takes, while ranks live
        (their heartbeats); a rank silent for ``timeout_s`` stops every rank."""
        if self.comm.heartbeat is not None:
            self.comm.heartbeat.wait_for_all(tag, self.timeout_s, doing)


def gathered(comm: Comm, value: Any, where: str, health: RankHealth | None = None) -> list[Any]:
    """Every rank's ``value`` on ``comm``, by rank (an object gather on its control group); a
    peer that left, or that the heartbeats' watch found silent, while this rank waited is the
    same RankStoppedError as in a step, naming it (``where``: the gather, for the message),
    through ``health`` where the caller has one (its step number and timeout), else through
    :func:`zerocc.engine.failures.peer_failure` alone. An error of this rank's own (a value
    that does not pickle) is raised as it is."""
    try:
        return comm.all_gather_object(value)
    except Exception as exc:
        if comm.failure is None:
            raise
        if health is not None:
            raise health.peer_failure(exc, where) from exc
        raise peer_failure(comm, exc, where) from exc


def run_failure(
    exc: BaseException,
    gm: fx.GraphModule,
    health: RankHealth,
    *,
    applied_steps: int,
    drop_window: Callable[[], int],
    new_signature: tuple | None,
    earlier: list[tuple],
) -> BaseException:
    """The error to raise for a run of the program ``gm`` that raised ``exc`` (``exc`` itself,
    with a note naming the failing node, when nothing can be added; ``applied_steps``: the
    optimizer steps applied before it). An OffloadError leaves the step's update incomplete. A
    failed collective is a peer that stopped answering: the heartbeats name it, and the group
    is closed (nothing more can run on it). Anything else leaves the step as before the
    micro-batch's accumulation window began (``drop_window()`` zeroes the gradient
    accumulators and drops that window's micro-batches, returning how many); a new program
    (``new_signature``, among the ``earlier`` batch signatures) that failed on its first run is
    not kept, and its error is a BatchError."""
    rank = health.comm.rank
    if isinstance(exc, OffloadError):
        return OffloadError(
            f"rank {rank}, step {applied_steps + 1}: {exc}. Training stopped: this "
            "step's update is incomplete; load the last checkpoint to go on"
        )
    node = failing_node(gm, exc.__traceback__)  # (named as the program's)
    step = health.step_number()
    if health.comm.failure is not None:
        return health.peer_failure(exc, describe_node(node))
    dropped = drop_window()
    if node is not None and info(node).phase == "optimizer":
        detail = "the update may be partly applied: load the last checkpoint to go on"
    else:
        detail = "nothing was updated" + (
            f"; the {dropped} micro-batch(es) accumulated for this step were dropped"
            if dropped
            else ""
        )
    if not isinstance(exc, Exception) or isinstance(exc, torch.OutOfMemoryError):
        return exc
    if new_signature is None or not earlier:
        exc.add_note(f"zerocc: rank {rank}, step {step}: in {describe_node(node)}")
        return exc
    return BatchError(
        f"rank {rank}, step {step}: the program compiled for a new batch signature "
        f"({signature_difference(new_signature, earlier)}) failed on its first run in "
        f"{describe_node(node)}: {type(exc).__name__}: {first_line(exc)}. The program was "
        f"not kept and {detail}. Give the model batches of the dtypes it takes (cast them in "
        "the data pipeline or the loss_fn)"
    )
