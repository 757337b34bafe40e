"""Local ranks for `zerocc train` and `zerocc profile`: launched through torch's own launcher,
watched while they run, and, when some fail, a report that says which, how and why.

Each rank writes what the launcher should know to a JSON file of its own in the run folder
(``ZEROCC_RUN_DIR``, a temporary folder): its pid, its predicted memory peak once its first
program is compiled, and its error when it fails, with the peers it found silent. The launcher
reads them:
- while the ranks run: a rank that reports peers that stopped answering on this machine (a
  process under SIGSTOP, or hung) has them killed at once; torchrun's own SIGTERM does not reach
  a stopped process, and it would wait 30 seconds before its SIGKILL;
- after a failure: one line per failed rank, with its signal by name, the likely cause where it
  can be known (SIGKILL and no error of its own: the out-of-memory killer, with the predicted
  peak next to the machine's memory) and its last error line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from zerocc.errors import ZeroccError
from zerocc.ir.quantities import human_bytes
from zerocc.local_ranks import local_rank
from zerocc.logs import RANK_PROCESSES, quiet
from zerocc.runtime import rendezvous
from zerocc.runtime.meeting import WaitNotices
from zerocc.runtime.nodes import Nodes
from zerocc.runtime.restarts import RUN_DIR_ENV, losses_recorded

RANK_WORKER_ENV = "ZEROCC_RANK_WORKER"  # set in launched ranks: run the command, do not launch
MEMORY_DIR_ENV = "ZEROCC_MEMORY_DIR"  # where launched ranks keep their in-memory checkpoints
LAUNCHER_PID_ENV = "ZEROCC_LAUNCHER_PID"  # the launcher whose end ends the ranks
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread ends
SHARED_MEMORY = Path("/dev/shm")  # tmpfs: host memory as files, outliving a rank's process


def in_memory_folder() -> Path | None:
    """Where a launched rank keeps its in-memory checkpoints (``checkpoint.in_memory``): a
    folder in shared memory, the same for every attempt of a restarted rank and every launch
    of one command (the smaller run ``--nproc-min`` starts reads the larger one's), removed
    at its end (:func:`memory_folder`); None outside zerocc's launcher."""
    folder = os.environ.get(MEMORY_DIR_ENV)
    return Path(folder) if folder else None


@contextlib.contextmanager
def memory_folder() -> Iterator[Path]:
    """A folder of shared memory for one run's in-memory checkpoints (its ranks make it as
    they save), removed with what it holds at the end."""
    folder = SHARED_MEMORY / f"zerocc-run-{secrets.token_hex(6)}"
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Launched(NamedTuple):
    """How a launch ended: ``status`` (0, 2 when ranks failed, ``128 + signal`` when a signal
    stopped them) and whether a rank was lost: it ended without an error of its own (killed,
    crashed), where ranks that all raised an error would meet it again with fewer ranks."""

    status: int
    lost_a_rank: bool = False


def launch(
    nproc: int,
    port: int,
    command: list[str],
    nodes: Nodes | None = None,
    max_restarts: int = 0,
    memory: Path | None = None,
) -> Launched:
    """Start ``nproc`` local ranks through torch.distributed.run, each running ``zerocc
    COMMAND...`` as a rank (of ``nodes.count × nproc`` when the run spans machines); when a
    rank fails, start every rank again, up to ``max_restarts`` times (torchrun's elastic
    agent; the ranks read ``TORCHELASTIC_RESTART_COUNT``). Failed ranks are reported here.
    The ranks keep their in-memory checkpoints in ``memory`` (:func:`memory_folder`, kept
    for a later launch), else in a folder of this launch's."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    nodes = nodes or Nodes()
    host, port = nodes.address(port)
    if (note := nodes.store_elsewhere()) is not None:
        print(note, file=sys.stderr, flush=True)
    elastic = nodes.count > 1 and max_restarts  # (a node replacing a lost one joins a round)
    if elastic:
        meeting = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                   "--rdzv-id", _rendezvous_id(nodes, host, port),
                   # node 0 keeps the store the rounds meet at (the others' loss it outlives),
                   # or `zerocc rendezvous` does (--rdzv-standalone)
                   "--rdzv-conf", nodes.rendezvous_conf()]  # fmt: skip
    else:
        meeting = ["--node-rank", str(nodes.rank), "--master-addr", host,
                   "--master-port", str(port)]  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="zerocc-run-") as run_dir,
        memory_folder() if memory is None else contextlib.nullcontext(memory) as kept_in,
        _rank_environment(nproc, run_dir, kept_in),
        # Each round's ranks meet at a store of their own, not the agents' (shared across
        # rounds, it holds the last round's addresses: the nodes' attempts differ, a
        # replacement's is 0, so no attempt prefix can keep them apart)
        (
            environment({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
            if elastic
            else contextlib.nullcontext()
        ),
    ):
        launcher_args = [
            "--nproc-per-node", str(nproc),
            "--nnodes", f"{nodes.fewest}:{nodes.count}" if elastic else str(nodes.count),
            *meeting,
            "--max-restarts", str(max_restarts),
            # (the agent's folder for the ranks' error files, a new /tmp/torchelastic_* per
            # launch left behind unless it is given one: this launch's, removed with it)
            "--log-dir", str(Path(run_dir) / "agent"),
            "-m", "zerocc", *command,
        ]  # fmt: skip
        watcher = _SilentRankKiller(Path(run_dir))
        notices = _wait_notices(nodes, host, port, elastic) if nodes.count > 1 else None
        # (torchrun closes the rendezvous for good when its run ends, but not on a signal)
        closes = elastic and nodes.standalone

        def lost(failures: dict[int, tuple[int, int]]) -> list[str]:  # (a restart's line)
            return restart_cause(failures, read_reports(Path(run_dir)), watcher)

        try:
            # (the store kept here, on the loopback interface for one machine, or checked
            # for the run's shared secret: rendezvous.meeting_place)
            with (
                quiet(RANK_PROCESSES),
                rendezvous.meeting_place(nodes, host, port),
                losses_recorded(Path(run_dir), lost),
            ):
                torchrun.run(torchrun.parse_args(launcher_args))
        except ChildFailedError as exc:
            failures = {
                rank: (failure.exitcode, failure.pid) for rank, failure in exc.failures.items()
            }
            reports = read_reports(Path(run_dir))
            stopped = _stopped_by(failures, reports)
            if stopped is not None:  # the ranks stopped as a signal asked (zerocc.cli.train)
                print(f"zerocc: stopped by {stopped.name}", file=sys.stderr)
                return Launched(128 + stopped)
            print(error_once(failures, reports), file=sys.stderr, end="")
            print(failure_report(failures, reports, watcher.killed, why=watcher.why),
                  file=sys.stderr)  # fmt: skip
            return Launched(2, lost_a_rank(failures, reports))
        except RendezvousConnectionError:  # (the store the nodes meet at is gone)
            closes = False
            print(f"zerocc: the rendezvous at {host}:{port} is gone, which ends the run: "
                  + _why_the_store_is_gone(nodes), file=sys.stderr)  # fmt: skip
            return Launched(2)
        except SignalException as exc:  # (torchrun passed the signal on to the ranks)
            closes = False
            name = signal.Signals(exc.sigval).name
            print(f"zerocc: stopped by {name}", file=sys.stderr)
            return Launched(128 + exc.sigval)
        finally:
            watcher.stop()
            if notices is not None:
                notices.stop()
            if closes:
                rendezvous.ended(host, port, nodes.run_name(port))
    return Launched(0)


def _wait_notices(nodes: Nodes, host: str, port: int, elastic: bool) -> WaitNotices:
    """What this launcher says while it waits at the rendezvous for the run's other machines."""
    own = "" if elastic else ", and its own --node-rank"
    fewer = (
        f"; the run goes on with fewer, down to {nodes.fewest}, after the rendezvous's last call"
        if nodes.fewest < nodes.count
        else ""
    )
    return WaitNotices(
        first=f"waiting at {host}:{port} for the run's other machines (--nnodes "
        f"{nodes.count}: each starts `zerocc train` with the same plan and flags{own})",
        again=f"waiting at {host}:{port} for the run's machines to meet again (a lost one is "
        f"replaced by `zerocc train` with the same flags on another machine{fewer})",
    )


def _why_the_store_is_gone(nodes: Nodes) -> str:
    if nodes.standalone:
        return ("the `zerocc rendezvous` there stopped (start it again, then the nodes, with "
                "--resume: ranks that were training saved where they stopped)")  # fmt: skip
    return (
        "node 0's launcher kept its store, and node 0 was lost; so that node 0 can be replaced "
        "too, keep the store on a machine of its own (`zerocc rendezvous`, and every node with "
        "--rdzv-standalone: docs/gpus.md)"
    )


def _rendezvous_id(nodes: Nodes, host: str, port: int) -> str:
    """This launch's ``--rdzv-id``: the run's name, and at a `zerocc rendezvous` (which
    outlives runs) the number of launches that ended under it there (checked to answer first).
    Node 0 keeping the store where a `zerocc rendezvous` answers is an error: it would keep a
    store of its own, which nobody else reads."""
    name = nodes.run_name(port)
    if nodes.standalone:
        rendezvous.wait_for(host, port)
        return rendezvous.run_id(host, port, name)
    if nodes.rank == 0 and rendezvous.answers(host, port):
        raise ZeroccError(
            f"a `zerocc rendezvous` answers at --rdzv-endpoint {host}:{port}, where node 0 would "
            "keep the store itself: pass --rdzv-standalone on every machine to meet there"
        )
    return name


def lost_a_rank(failures: dict[int, tuple[int, int]], reports: dict[int, dict[str, Any]]) -> bool:
    """Whether a failed rank ended without an error of its own (killed, crashed): its peers'
    errors then only say it is gone."""
    return any(not reports.get(rank, {}).get("error") for rank in failures)


def _stopped_by(
    failures: dict[int, tuple[int, int]], reports: dict[int, dict[str, Any]]
) -> signal.Signals | None:
    """The signal every failed rank stopped by, when each exited ``128 + signal`` (SIGINT or
    SIGTERM: a rank's clean stop) without an error of its own; else None."""
    codes = {code for code, _ in failures.values()}
    clean = {128 + signal.SIGINT, 128 + signal.SIGTERM}
    if len(codes) != 1 or not codes <= clean or any(r.get("error") for r in reports.values()):
        return None
    return signal.Signals(codes.pop() - 128)


def _rank_environment(nproc: int, run_dir: str, memory: Path) -> contextlib.AbstractContextManager:
    """The variables the launched ranks inherit: they run the command instead of launching
    again, report to ``run_dir``, keep in-memory checkpoints in ``memory``, and share the
    cores (torchrun would give each one thread)."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    return environment({RANK_WORKER_ENV: "1", RUN_DIR_ENV: run_dir, MEMORY_DIR_ENV: str(memory),
                        LAUNCHER_PID_ENV: str(os.getpid()),
                        "OMP_NUM_THREADS": threads})  # fmt: skip


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in os.environ for the body, restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- what a rank reports ------------------------------------------------------------------


@functools.cache
def started_before() -> bool:
    """Whether this launch started this local rank before: a restart after a failure, or a new
    round after the machines changed (one joined, or a lost one was not replaced:
    ``--nnodes MIN:N``), which torchrun starts without counting a restart. Marked in the run
    folder, once per process; False outside zerocc's launcher."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return False
    marker = Path(run_dir) / f"started.local-rank-{local_rank()}"
    if marker.exists():
        return True
    marker.touch()
    return False


def end_with_launcher() -> None:
    """In a rank that zerocc's launcher started (``ZEROCC_LAUNCHER_PID``), on Linux: have the
    kernel SIGKILL this process when the launcher ends (``prctl(PR_SET_PDEATHSIG)``), and end
    it now if the launcher ended already (it was given to another parent before the call). A
    launcher killed with SIGKILL cannot stop its ranks itself: they trained on as orphans.
    Elsewhere, or where prctl fails, nothing changes (the collectives' timeout ends them)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # (ended before the call: no death signal will come)
        os.kill(os.getpid(), signal.SIGKILL)


def launched() -> bool:
    """Whether this process is already a rank (launched by zerocc or an outside torchrun)."""
    return RANK_WORKER_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def report(**fields: Any) -> None:
    """Add ``fields`` to this rank's report, when it was launched by zerocc (else nothing). A
    rank started again (``--max-restarts``) begins a new report: the last attempt's is what the
    launcher reads."""
    run_dir, rank = os.environ.get(RUN_DIR_ENV), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    path = Path(run_dir) / f"rank{rank}.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    if current.get("pid") != os.getpid():
        current = {}
    current.update(fields, rank=int(rank), pid=os.getpid(), host=socket.gethostname())
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(current))
    partial.replace(path)  # readers never see half a report


def read_reports(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's report so far, by rank."""
    reports = {}
    for path in run_dir.glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        reports[int(data["rank"])] = data
    return reports


class _SilentRankKiller:
    """Kills, on this machine, the ranks another rank reported as silent (stopped or hung), and
    a rank still stopped (SIGSTOP) once another rank has ended: torchrun's SIGTERM stays
    pending on a stopped process until its SIGKILL 30 s later. It waits for the reporting rank
    to exit first (at most a few seconds), so that the launcher learns of the failure from the
    rank that saw it. Only a process still there is killed and counted as this launcher's
    kill (``killed``, with why in ``why``): one already dead (a SIGKILL from elsewhere, which
    made its peers report it) is not."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.killed: dict[int, int] = {}  # rank -> pid
        self.why: dict[int, str] = {}  # rank -> why the launcher killed it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerocc-launch-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host = socket.gethostname()
        first_seen: dict[int, float] = {}  # reporting pid -> when its report named silent peers
        while not self._stop.wait(0.2):
            reports = read_reports(self.run_dir)
            for data in reports.values():
                if not data.get("silent"):
                    continue
                first_seen.setdefault(data["pid"], time.monotonic())
                if _alive(data["pid"]) and time.monotonic() - first_seen[data["pid"]] < 3:
                    continue
                for peer in data["silent"]:
                    if peer.get("pid") and peer.get("host") == host:
                        self._kill(peer["rank"], peer["pid"],
                                   f"it stopped answering its peers (rank {data['rank']} "
                                   "reported it silent), and the launcher killed it")  # fmt: skip
            self._kill_stopped(reports)

    def _kill_stopped(self, reports: dict[int, dict[str, Any]]) -> None:
        """A rank stopped (SIGSTOP, Ctrl-Z) while another rank of this launch has ended: the
        run is over, and only SIGKILL reaches a stopped process."""
        states = {rank: _process_state(data["pid"]) for rank, data in reports.items()}
        ended = sorted(rank for rank, state in states.items() if state in ("Z", None))
        if not ended:
            return
        for rank, state in states.items():
            if state == "T":
                self._kill(rank, reports[rank]["pid"],
                           f"it was stopped (SIGSTOP) when rank {ended[0]} ended, and the "
                           "launcher killed it")  # fmt: skip

    def _kill(self, rank: int, pid: int, why: str) -> None:
        """SIGKILL ``pid`` (rank ``rank``) if it still runs or is stopped, and count it."""
        if pid in self.killed.values() or _process_state(pid) in ("Z", None):
            return  # (killed already, or dead: not this launcher's doing)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed[rank], self.why[rank] = pid, why

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (or is stopped): not gone, not a zombie waiting to be
    reaped."""
    return _process_state(pid) not in ("Z", None)


def _process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``T``: stopped, ``Z``: ended, not yet
    reaped, ...), None when there is no such process. Where /proc is missing, ``?`` for a
    process that exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


# --- the failure report -------------------------------------------------------------------


def _first_failed(failures: dict[int, tuple[int, int]], reports: dict[int, dict[str, Any]]):
    """The rank whose error the launcher prints: the first with a traceback (an unexpected
    exception), else the first with an error; None when no failed rank said one."""
    said = [r for r in sorted(failures) if reports.get(r, {}).get("error")]
    traced = [r for r in said if reports[r].get("traceback")]
    return (traced or said or [None])[0]


def error_once(failures: dict[int, tuple[int, int]], reports: dict[int, dict[str, Any]]) -> str:
    """The error the run ended on, once, as the first failed rank met it: its traceback (an
    unexpected exception), or its zerocc error's whole message (the ranks do not print it
    themselves: each that met it would, one line each). Empty when no failed rank said one."""
    first = _first_failed(failures, reports)
    if first is None:
        return ""
    data = reports[first]
    if data.get("traceback"):
        return f"zerocc: rank {first}'s error:\n{data['traceback']}"
    errors = [reports[r]["error"] for r in failures if reports.get(r, {}).get("error")]
    where = "" if len(errors) > 1 and set(errors) == {data["error"]} else f"rank {first}: "
    return f"zerocc: {where}error: {data.get('message', data['error'])}\n"


def failure_report(
    failures: dict[int, tuple[int, int]],
    reports: dict[int, dict[str, Any]],
    killed: dict[int, int],
    memory_total: int | None = None,
    why: dict[int, str] | None = None,
) -> str:
    """One line per failed rank (``failures``: rank -> (exit code, pid)): how it ended, the
    likely cause, its last error line (or that it is the one :func:`error_once` printed).
    ``killed``: the ranks this launcher killed (rank -> pid), ``why`` it did."""
    lines = [f"zerocc: {len(failures)} rank(s) failed:"]
    first_error = min((r for r in failures if reports.get(r, {}).get("error")), default=None)
    printed = _first_failed(failures, reports)  # (its error printed by :func:`error_once`)
    for rank in sorted(failures):
        code, pid = failures[rank]
        data = reports.get(rank, {})
        error = data.get("error")
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        cause = _likely_cause(rank, code, data, killed, first_error, failures, memory_total)
        if cause and killed.get(rank) == pid and why and rank in why:
            cause = why[rank]
        text = f"  rank {rank} (pid {pid}): {how}"
        if cause:
            text += f": {cause}"
        if error:
            if printed is not None and error == reports[printed]["error"]:
                error = f"the error above ({error.split(':', 1)[0]})"
            text += f"\n    last error: {error}"
        lines.append(text)
    return "\n".join(lines)


def restart_cause(
    failures: dict[int, tuple[int, int]],
    reports: dict[int, dict[str, Any]],
    watcher: _SilentRankKiller,
) -> list[str]:
    """What ended an attempt that torchrun restarts from, a phrase per rank: the ranks lost
    without an error of their own (killed, crashed), as the failure report says them, else
    every failed rank with its error (the ranks that met a lost peer's absence are not the
    cause)."""
    lost = {r: f for r, f in failures.items() if not reports.get(r, {}).get("error")}
    if lost:
        report = failure_report(lost, reports, watcher.killed, why=watcher.why)
        return [line.strip() for line in report.splitlines()[1:]]
    return [
        f"rank {r} (pid {pid}): {_ended(code)}: {reports[r]['error']}"
        for r, (code, pid) in sorted(failures.items())
    ]


def _ended(code: int) -> str:
    """How a rank ended, in a few words: ``killed by SIGKILL``, ``exit code 1``."""
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _likely_cause(
    rank: int,
    code: int,
    data: dict[str, Any],
    killed: dict[int, int],
    first_error: int | None,
    failures: dict[int, tuple[int, int]],
    memory_total: int | None,
) -> str:
    if killed.get(rank) == failures[rank][1]:  # (this process, not an earlier attempt's)
        return "it stopped answering its peers, and the launcher killed it"
    if code == -signal.SIGKILL and not data.get("error"):
        return _out_of_memory(data, len(failures), memory_total)
    if code == -signal.SIGTERM and first_error is not None and first_error != rank:
        return f"stopped by the launcher after rank {first_error} failed"
    if code == -signal.SIGTERM and not data.get("error"):
        others = sorted(r for r, (c, _) in failures.items() if r != rank and c != -signal.SIGTERM)
        if others:
            ended = ", ".join(f"rank {r} ({_ended(failures[r][0])})" for r in others)
            return f"stopped by the launcher after {ended} ended"
    if code == -signal.SIGABRT and not data.get("error"):
        return "aborted in native code (a crash in a library, or C++ std::terminate)"
    if code == -signal.SIGSEGV:
        return "a segmentation fault in native code"
    return ""


def _out_of_memory(data: dict[str, Any], ranks: int, memory_total: int | None) -> str:
    """SIGKILL with no error of the rank's own: the out-of-memory killer sends it, and so may a
    person or a scheduler; the launcher cannot tell which. It says what it knows: the rank's
    predicted need next to what the machine has, and which way that points."""
    total = memory_total if memory_total is not None else _machine_memory()
    peak, local = data.get("predicted_peak_bytes"), data.get("local_ranks")
    figures = []
    if peak:
        figures.append(f"predicted peak {human_bytes(peak)} per rank")
    if peak and local:
        figures.append(f"{human_bytes(peak * local)} for the {local} ranks on this machine")
    if total:
        figures.append(f"this machine has {human_bytes(total)}")
    shown = f" ({'; '.join(figures)})" if figures else ""
    text = "killed without an error of its own, not by this launcher's watch: by the "
    text += "out-of-memory killer or by a person or a scheduler"
    if ranks > 1:  # (torchrun's own SIGKILL ends a rank that outlives its SIGTERM by 30 s)
        text += ", or by torchrun 30 s after its SIGTERM"
    text += " (SIGKILL does not say who)" + shown
    if peak and local and total:
        if peak * local > total:
            return text + ": the prediction exceeds the machine; see `zerocc estimate` for plans "
            "that need less"
        return text + ": the prediction fits the machine, so a kill from outside is likelier"
    return text + "; see `zerocc estimate` for plans that need less"


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
