"""Where a program run failed, in the program's own words: the node that raised, how a batch
that broke a new program differs from the batches before it, and who stopped answering when a
collective failed.

The node is read off the exception's traceback at no cost to the run: torch.fx compiles a
program's ``forward`` from generated source, one statement per node (``addmm = torch.ops...``),
so the frame of that code and its line name the node.
"""

from __future__ import annotations

import linecache
import re
from types import TracebackType

from torch import fx

from zerocc.engine.comm import Comm
from zerocc.engine.watchdog import (
    PeersSilent,
    describe_divergence,
    describe_silence,
    silent_peers,
)
from zerocc.errors import RankStoppedError
from zerocc.ir.nodes import info

_ASSIGNED = re.compile(r"^\s*(\w+)\s*=")  # "addmm = ..." (and "... ;  free = None")


def failing_node(gm: fx.GraphModule, tb: TracebackType | None) -> fx.Node | None:
    """The node of ``gm`` whose statement was running when the traceback ``tb`` was raised,
    or None when the failure was not inside ``gm``'s generated code."""
    code = type(gm).forward.__code__
    line = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is code:
            line = linecache.getline(code.co_filename, tb.tb_lineno, frame.f_globals)
        tb = tb.tb_next
    match = _ASSIGNED.match(line or "")
    if match is None:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    return nodes.get(match.group(1))


def describe_node(node: fx.Node | None) -> str:
    """``node addmm_2 (aten.addmm, backward of module 'fc', unit 'h.0')``; 'an unknown op'."""
    if node is None:
        return "an op of the program"
    record = info(node)
    target = getattr(node.target, "__name__", str(node.target))
    where = [target]
    if record.phase:
        where.append(
            f"{record.phase} of module {record.module!r}"
            if record.module is not None
            else str(record.phase)
        )
    if record.unit:
        where.append(f"unit {record.unit!r}")
    if record.note:
        where.append(record.note)
    return f"node {node.name} ({', '.join(where)})"


def signature_difference(new: tuple, earlier: list[tuple]) -> str:
    """How a batch signature (see ``zerocc.train_step.batch_signature``) differs from the
    closest earlier one: ``batch[0]: float64 (3, 4), earlier float32 (3, 4)``."""
    if not earlier:
        return "the first batch"

    def changes(old: tuple) -> list[str]:
        if len(old) != len(new):
            return [f"{len(new)} batch elements, earlier {len(old)}"]
        return [
            f"batch[{i}]: {_show(a)}, earlier {_show(b)}"
            for i, (a, b) in enumerate(zip(new, old, strict=True))
            if a != b
        ]

    closest = min((changes(old) for old in earlier), key=len)
    return "; ".join(closest) or "a batch like an earlier one"


def _show(element: tuple) -> str:
    if element[0] == "tensor":
        dtype = element[2].removeprefix("torch.")
        return f"{dtype} tensor of shape {tuple(element[1])}"
    return f"value {element[1]!r}"


def peer_failure(
    comm: Comm,
    exc: BaseException,
    where: str,
    step: int | None = None,
    timeout_s: float | None = None,
) -> RankStoppedError:
    """The error of a collective that failed (``exc``, in ``where``; at ``step``, with the
    plan's ``timeout_s``, where the caller knows them): who stopped answering (a survey of the
    heartbeats), with ``comm`` closed so that the process can exit without waiting for the
    collectives still queued on it."""
    survey = comm.heartbeat.survey() if comm.heartbeat else None
    comm.close()
    at = f"rank {comm.rank}" + (f", step {step}" if step is not None else "")
    timeout = f"backend.timeout_s ({timeout_s:g} s)" if timeout_s is not None else "the timeout"
    alike, mesh = survey, comm.root.mesh  # the ranks that run the same programs as this one
    if survey is not None and mesh is not None and mesh.pp > 1:  # (stages run other programs)
        alike = [s for s in survey if mesh.pp_rank(s.rank) == mesh.pp_rank(comm.rank)]
    parted = describe_divergence(alike)
    parted = f"; {parted}" if parted else ""
    silent = silent_peers(survey, comm.rank)
    said = describe_silence(survey, comm.rank)
    if isinstance(exc, PeersSilent):  # the watch named them: say them as it saw them
        if not silent:  # (back since, or the store no longer answers the survey)
            silent, said = exc.silent, "; ".join(s.describe() for s in exc.silent)
        whose = " and ".join(f"rank {s.rank}" for s in exc.silent)
        gave_up = (
            f"after {whose}'s heartbeat stood still for {exc.silence_s:g} s (the heartbeats' "
            f"watch; {timeout} bounds any collective)"
        )
    else:
        gave_up = f"after {timeout} or when the peer left ({type(exc).__name__}: {first_line(exc)})"
    return RankStoppedError(
        f"{at}: {said}{parted}. This rank gave up in {where} {gave_up}. Training "
        "stopped; start the ranks again and load the last checkpoint",
        silent,
    )


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
