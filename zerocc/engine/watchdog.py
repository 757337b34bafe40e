"""Who is still answering: a heartbeat per rank, so that a rank that waited too long can name
the peers that stopped, and so that compilation never counts against ``backend.timeout_s``.

Every rank of a zerocc process group runs a :class:`Heartbeat` thread that writes a small record
to the job's rendezvous store once a second: a sequence number that grows while the process runs,
its pid and host, and what its training step is doing (``status``, set by the TrainStep: cheap
attribute writes, no store traffic on the hot path). A rank whose sequence number stops moving has
stopped answering: it was stopped (SIGSTOP, a debugger), is hung in native code holding the
interpreter, was killed, or exited. Sequence numbers, not clocks, so hosts need not agree on time.

Three uses:
- the watch: each beat the thread also reads the peers it watches (rank 0: every other rank;
  the others: rank 0, and the word rank 0 posts) and keeps who has been silent for
  ``silence_s`` (:attr:`Heartbeat.lost`). A rank blocked in a collective waits in slices
  (:func:`wait_watched`) and gives up with :class:`PeersSilent` once the watch names a peer,
  wherever it waits: in a step, in the metrics' gather, in a checkpoint's agreement. That is
  within ``silence_s`` (``SILENT_S``, 30 s, or ``backend.timeout_s`` where it is shorter),
  not after the process group's own timeout (600 s by default).
- :meth:`Heartbeat.survey`: after a collective failed or timed out, which peers are silent and
  what each was last doing (two readings a few beats apart).
- :meth:`Heartbeat.wait_for_all`: a rendezvous that waits for every rank however long it takes
  while it is alive (one compiling a new program), but stops with an error once a missing rank
  has been silent for ``silence_s``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from zerocc.errors import RankStoppedError
from zerocc.ir.quantities import human_bytes

BEAT_S = 1.0  # seconds between two records of a rank
MIN_BEAT_S = 0.2  # a new status is written at once, but never more often than this
STOP_TIMEOUT_S = 10.0  # how long stopping waits for a beat in progress (a store call)
STORE_ANSWER_S = 5.0  # how long a survey waits for the store itself before saying it is silent
# How long a peer's heartbeat may stand still before the ranks waiting on it give up (at most
# backend.timeout_s): a live rank beats every second whatever it runs (the beat is a thread of
# its own; compiling, loading and long kernels release the interpreter), so 30 silent seconds
# are a stopped, hung or killed process, named long before the collectives' own timeout.
SILENT_S = 30.0
WAIT_SLICE_S = 1.0  # a watched wait looks at the watch this often


class PeersSilent(RuntimeError):
    """A watched wait gave up: the watch found ``silent`` peers (PeerStates) that had not
    beaten for ``silence_s`` seconds. Raised where a collective's own failure would be, so
    every caller's peer-failure path (``zerocc.engine.failures.peer_failure``) names them."""

    def __init__(self, silent: list[PeerState], silence_s: float) -> None:
        super().__init__(
            "; ".join(s.describe() for s in silent) + f", silent for {silence_s:g} s"
        )
        self.silent, self.silence_s = silent, silence_s


@dataclass(frozen=True)
class PeerState:
    """What a survey saw of one rank."""

    rank: int
    answering: bool
    pid: int | None = None
    host: str | None = None
    status: str = ""  # what its step was doing at its last beat ("" if it never beat)
    exited: bool = False  # its last record says the process was exiting
    recent: tuple = ()  # its last collectives at its last beat: (number, kind, bytes)

    def describe(self) -> str:
        """One phrase for an error message: 'rank 1 (pid 123 on host) stopped answering ...'."""
        where = f" (pid {self.pid} on {self.host})" if self.pid else ""
        if self.exited:
            return f"rank {self.rank}{where} exited" + (f" ({self.status})" if self.status else "")
        if self.pid is None:
            return f"rank {self.rank} never answered"
        last = f"; last seen {self.status}" if self.status else ""
        return f"rank {self.rank}{where} stopped answering (stopped, hung or killed{last})"


class Heartbeat:
    """A background thread that records this rank as alive in ``store`` under ``prefix``."""

    def __init__(
        self, store: Any, prefix: str, rank: int, world_size: int, silence_s: float = SILENT_S
    ) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.silence_s = silence_s  # how long a watched peer may stand still (see SILENT_S)
        self.lost: list[PeerState] = []  # the watched peers silent for silence_s, once found
        self._watched: dict[int, tuple[int, float]] = {}  # rank -> (seq, when it last moved)
        self._status = "setting up the training step"
        self.recent: Iterable = ()  # this rank's last collectives (CommStats.recent)
        self._seq = 0
        self._exiting = False
        self._stop = threading.Event()
        self._news = threading.Event()
        self._beat()  # the first record exists before anyone can look for it
        self._thread = threading.Thread(target=self._run, name="zerocc-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/heartbeat/{rank}"

    def _beat(self) -> None:
        self._seq += 1
        record = {
            "seq": self._seq,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "status": self.status,
            "exited": self._exiting,
            "recent": list(self.recent),  # (one C call: no other thread runs inside it)
        }
        self.store.set(self._key(self.rank), json.dumps(record))

    @property
    def status(self) -> str:
        """What this rank's training step is doing, as the others will read it."""
        return self._status

    @status.setter
    def status(self, status: str) -> None:
        self._status = status
        self._news.set()  # told within MIN_BEAT_S, so the last record is what the rank did

    def _run(self) -> None:
        next_watch = 0.0
        while not self._stop.is_set():
            self._news.wait(BEAT_S)
            self._news.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
                # (the watch once a beat, not once a status: rank 0 reads every rank's record)
                if not self.lost and self.world_size > 1 and time.monotonic() >= next_watch:
                    next_watch = time.monotonic() + BEAT_S
                    self._watch()
            except Exception:  # the store is gone (the job is ending): nothing left to tell
                return
            self._stop.wait(MIN_BEAT_S)

    def _watch(self) -> None:
        """One look at the watched peers (rank 0: every other rank, posting what it finds for
        the others; the others: rank 0 and rank 0's post): ``lost`` once one has stood still
        for ``silence_s`` (an exited peer is left to its collectives, which fail at once)."""
        lost_key = f"{self.prefix}/lost"
        if self.rank != 0 and self.store.check([lost_key]):
            posted = json.loads(self.store.get(lost_key))
            self.lost = [PeerState(**{**p, "recent": tuple(p["recent"])}) for p in posted]
            return
        now = time.monotonic()
        silent = [
            s
            for s in self._silent_for(self.silence_s, self._watched, now)
            if not s.exited and s.pid is not None
        ]
        if silent and self.rank == 0:
            self.store.set(lost_key, json.dumps([vars(s) for s in silent]))
        self.lost = silent

    def stop(self, exiting: bool = True) -> None:
        """Stop beating; the last record says the process exited (``exiting``), so a survey
        tells an exited rank from a hung one."""
        self._stop.set()
        self._news.set()
        self._exiting = exiting
        # Joined, not left to die with the interpreter: a daemon thread caught in a store call
        # while the interpreter finalizes aborts the process (SIGABRT on a clean exit).
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_TIMEOUT_S)
        try:
            self._beat()
        except Exception:
            pass

    # -- reading the others -----------------------------------------------------------------

    def _records(self, ranks: list[int] | None = None) -> dict[int, dict]:
        """The last record of each of ``ranks`` (default: every rank) that has one."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        present = [r for r in ranks if self.store.check([self._key(r)])]
        if not present:
            return {}
        keys = [self._key(r) for r in present]
        values = (
            self.store.multi_get(keys)
            if hasattr(self.store, "multi_get")
            else [self.store.get(k) for k in keys]
        )
        return {r: json.loads(v) for r, v in zip(present, values, strict=True)}

    def survey(self) -> list[PeerState] | None:
        """The state of every rank: two readings of the store ``2.5`` beats apart; a rank whose
        record did not change in between is silent. None when the store itself does not answer
        (outside torchrun it runs inside rank 0's process, which may be the silent one)."""
        first = _within(STORE_ANSWER_S, self._records)
        if first is None:
            return None
        time.sleep(2.5 * BEAT_S)
        second = _within(STORE_ANSWER_S, self._records)
        if second is None:
            return None
        states = []
        for rank in range(self.world_size):
            record = second.get(rank)
            moved = record is not None and (
                rank == self.rank or record["seq"] != first.get(rank, {}).get("seq")
            )
            states.append(_state(rank, record, answering=moved and not record["exited"]))
        return states

    def wait_for_all(self, tag: str, timeout_s: float, doing: str) -> None:
        """Return once every rank called ``wait_for_all(tag)``: however long a live rank takes
        (compiling), but raise RankStoppedError on every rank once a missing rank's heartbeat
        has not moved for ``timeout_s``. ``doing``: what the ranks wait for, for the message.

        Store traffic stays small at any scale: each rank polls one counter; rank 0 watches the
        heartbeats of the missing ranks and posts a failure for all to read; the other ranks
        watch rank 0's alone."""
        count_key, failure_key = f"{self.prefix}/{tag}/arrived", f"{self.prefix}/{tag}/failure"
        self.store.add(count_key, 1)
        watched: dict[int, tuple[int, float]] = {}  # rank -> (seq, when it last moved)
        pause, next_look = 0.005, time.monotonic() + BEAT_S
        limit_s = min(timeout_s, self.silence_s)
        while self.store.add(count_key, 0) < self.world_size:
            if self.store.check([failure_key]):
                raise RankStoppedError(self.store.get(failure_key).decode())
            now = time.monotonic()
            if now >= next_look:
                next_look = now + BEAT_S
                silent = self._silent_for(limit_s, watched, now)
                if silent:
                    message = (
                        "; ".join(s.describe() for s in silent)
                        + f", while the other ranks waited for {doing} (silent for "
                        f"{limit_s:g} s; backend.timeout_s: {timeout_s:g} s)"
                    )
                    self.store.set(failure_key, message)
                    raise RankStoppedError(message, silent)
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def _silent_for(
        self, timeout_s: float, watched: dict[int, tuple[int, float]], now: float
    ) -> list[PeerState]:
        """Of the ranks this rank watches (rank 0: all others; the rest: rank 0), those whose
        heartbeat has not moved for ``timeout_s`` or that exited."""
        others = range(1, self.world_size) if self.rank == 0 else [0]
        records = self._records(list(others))
        silent = []
        for rank in others:
            record = records.get(rank, {"seq": -1, "exited": False})
            if watched.get(rank, (None,))[0] != record["seq"]:
                watched[rank] = (record["seq"], now)
            if record["exited"] or now - watched[rank][1] > timeout_s:
                silent.append(_state(rank, record, answering=False))
        return silent


def wait_watched(work: Any, heartbeat: Heartbeat | None, *, point_to_point: bool = False) -> None:
    """``work.wait()`` for a process group's work handle, in slices of ``WAIT_SLICE_S``: once
    the heartbeat's watch names a silent peer, raise :class:`PeersSilent` instead of waiting
    out the group's timeout. Without a heartbeat (no peers), a plain wait. A wait that ended
    is not looked at again: the hot path pays one wait call when the answer is there.

    ``point_to_point``: a gloo send or receive (``isend``/``irecv``). Its timed wait does not
    leave it pending as a collective's does: when the slice runs out, gloo closes the pair and
    the work fails, so a peer one second late (compiling its program, say) would end the run.
    It is waited for whole in a thread of its own while this one looks at the watch."""
    if heartbeat is None:
        work.wait()
        return
    if point_to_point:
        _wait_in_thread(work, heartbeat)
        return
    while True:
        try:
            if work.wait(timeout=timedelta(seconds=WAIT_SLICE_S)) is not False:
                return
        except Exception:  # gloo: "Operation timed out!", the work still pending
            if work.is_completed():  # (it failed: a peer left, or the group's own timeout)
                raise
        if heartbeat.lost:
            raise PeersSilent(heartbeat.lost, heartbeat.silence_s)


def _wait_in_thread(work: Any, heartbeat: Heartbeat) -> None:
    """``work.wait()`` in a daemon thread, this thread looking at the watch every slice: the
    wait's own error is raised here; a silent peer raises :class:`PeersSilent` (the thread is
    left waiting: the group is unusable from then on, and the process ends with it)."""
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait()
        except BaseException as exc:  # (raised in the caller's thread below)
            failure.append(exc)

    thread = threading.Thread(target=wait, name="zerocc-p2p-wait", daemon=True)
    thread.start()
    while True:
        thread.join(WAIT_SLICE_S)
        if not thread.is_alive():
            if failure:
                raise failure[0]
            return
        if heartbeat.lost:
            raise PeersSilent(heartbeat.lost, heartbeat.silence_s)


def _state(rank: int, record: dict | None, answering: bool) -> PeerState:
    if record is None or "pid" not in record:
        return PeerState(rank, answering=False)
    recent = tuple(tuple(entry) for entry in record.get("recent", ()))
    return PeerState(
        rank, answering, record["pid"], record["host"], record["status"], record["exited"], recent
    )


def _within(seconds: float, read: Callable[[], Any]) -> Any:
    """``read()``, or None when it does not return within ``seconds`` (a store that no longer
    answers would block for the store's own timeout, minutes)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(read()), daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def silent_peers(states: list[PeerState] | None, rank: int) -> list[PeerState]:
    """The ranks other than ``rank`` a survey found silent."""
    return [s for s in states or [] if not s.answering and s.rank != rank]


def describe_silence(states: list[PeerState] | None, rank: int) -> str:
    """Name the ranks a survey found silent, or say that nobody could be asked."""
    if states is None:
        return (
            "a peer stopped answering, and the rendezvous store does not answer either "
            "(outside torchrun it runs in rank 0's process, which may be the one that stopped)"
        )
    silent = silent_peers(states, rank)
    if not silent:
        busy = [f"rank {s.rank} ({s.status})" for s in states if s.rank != rank and s.status]
        return "every rank still answers, but not in this collective: " + (
            ", ".join(busy) or "they are busy elsewhere"
        )
    return "; ".join(s.describe() for s in silent)


def describe_divergence(states: list[PeerState] | None) -> str:
    """Where the ranks' last collectives part, from what each rank's heartbeat last told (its
    ``recent`` log): the first number at which two ranks issued different collectives (a rank
    on another code path: a step ahead, a save the others did not make), else the ranks whose
    last collective is behind the others' (still computing, or waiting elsewhere); "" when the
    logs say nothing more (every rank in the same collective, or no log)."""
    logs = {
        s.rank: {n: (kind, size) for n, kind, size in s.recent} for s in states or [] if s.recent
    }
    if len(logs) < 2:
        return ""
    for number in sorted(set().union(*logs.values())):
        issued = {rank: log[number] for rank, log in logs.items() if number in log}
        if len(set(issued.values())) > 1:
            each = ", ".join(f"rank {r}: {_collective(*c)}" for r, c in sorted(issued.items()))
            return f"the ranks' collectives part at number {number} ({each})"
    last = {rank: max(log) for rank, log in logs.items()}
    ahead = max(last.values())
    behind = sorted(r for r, n in last.items() if n < ahead)
    if not behind:
        return ""
    at = logs[next(r for r, n in last.items() if n == ahead)][ahead]
    each = ", ".join(f"rank {r} at {last[r]} ({_collective(*logs[r][last[r]])})" for r in behind)
    return (
        f"the others issued collective number {ahead} ({_collective(*at)}); {each}: behind "
        "(still computing, or waiting elsewhere)"
    )


def _collective(kind: str, nbytes: int) -> str:
    return kind if kind == "agreement" else f"{kind} of {human_bytes(nbytes)}"
