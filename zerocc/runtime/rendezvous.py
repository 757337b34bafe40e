"""A rendezvous that no training machine holds: `zerocc rendezvous` keeps the store where the
machines of a run that restarts (`zerocc train --nnodes N --max-restarts M`) meet, on a
machine of its own (a login or head node), so that any training machine, node 0's included,
can be lost and replaced.

Without it node 0's launcher keeps that store (torchrun's c10d rendezvous, ``is_host``), and a
lost node 0 takes the run with it. The store here is torch's own ``TCPStore``, which the c10d
rendezvous reads as a client (``is_host=false`` on every node), plus two keys of zerocc's:
- :data:`MARK`, which a node checks before it joins, so that a run pointed at the wrong address
  says so instead of waiting out the rendezvous's timeout;
- a count per run name of the launches that ended on it: torchrun closes a rendezvous for good
  when its run ends, so each run on a store that outlives it meets under a name of its own,
  ``NAME.K`` (:func:`run_id`).
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from datetime import timedelta

from zerocc.errors import ZeroccError

MARK = "zerocc/rendezvous"  # set by `zerocc rendezvous`: what a node checks it meets at
ENDED = "zerocc/ended/"  # + run name: launches ended under that name (a counter)
DEFAULT_PORT = 29500  # (torchrun's)


def serve(port: int = DEFAULT_PORT) -> None:
    """Keep a rendezvous store on ``port`` of this machine (every address) until SIGINT or
    SIGTERM, saying where once it listens."""
    from torch.distributed import TCPStore

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # (taken below, not by a handler)
    try:
        store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, use_libuv=True)
    except Exception as exc:  # (torch's DistNetworkError, or a RuntimeError: port in use)
        raise ZeroccError(f"cannot listen on port {port}: {exc}") from None
    store.set(MARK, "1")
    host = socket.getfqdn()
    print(f"zerocc rendezvous: listening on {host}:{port}; start `zerocc train` on every "
          f"machine with --rdzv-endpoint {host}:{port} --rdzv-standalone (and --nnodes, "
          "--max-restarts); Ctrl-C ends it", flush=True)  # fmt: skip
    caught = signal.sigwait(stop)
    print(f"zerocc rendezvous: stopped by {signal.Signals(caught).name}", flush=True)


def _store(host: str, port: int, timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def _listening(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts connections at ``host:port`` (a plain socket, before a store
    client, which logs a C++ error per failed try)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def answers(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a `zerocc rendezvous` answers at ``host:port`` within ``timeout`` seconds (False
    at once where nothing listens). The store's client is asked on a thread of its own: where
    something else listens and never replies, it would wait on its first read for good."""
    if not _listening(host, port, timeout):
        return False
    answer: list[bool] = []

    def ask() -> None:
        try:
            answer.append(_store(host, port, timeout).check([MARK]))
        except Exception:  # (something else listens there, which closed on the store's hello)
            answer.append(False)

    asking = threading.Thread(target=ask, name="zerocc-rendezvous-check", daemon=True)
    asking.start()
    asking.join(timeout + 1.0)
    return bool(answer and answer[0])


def wait_for(host: str, port: int, timeout: float = 60.0) -> None:
    """Wait up to ``timeout`` seconds for a `zerocc rendezvous` at ``host:port`` (the machines
    of a job may start with it); a ZeroccError naming the address when none answers."""
    deadline = time.monotonic() + timeout
    while not answers(host, port):
        if time.monotonic() > deadline:
            raise ZeroccError(
                f"--rdzv-standalone: no `zerocc rendezvous` answers at {host}:{port} after "
                f"{timeout:.0f} s; start `zerocc rendezvous --port {port}` on {host} first (or "
                "leave --rdzv-standalone out: node 0's launcher then keeps the store)"
            )
        time.sleep(1.0)


def run_id(host: str, port: int, name: str) -> str:
    """The name this launch meets under at the store at ``host:port``: ``NAME.K``, K the
    launches that ended under ``name`` there so far. The machines of one run agree on it: they
    all start, or a replacement joins, before any of them ends."""
    return f"{name}.{_store(host, port, 10.0).add(ENDED + name, 0)}"


def ended(host: str, port: int, name: str) -> None:
    """Count a launch under ``name`` as ended (its rendezvous closed): the next run under it
    meets under a new name. A store gone by now is said, not raised: the run is over."""
    try:
        _store(host, port, 10.0).add(ENDED + name, 1)
    except Exception as exc:
        print(f"zerocc: the rendezvous at {host}:{port} is gone ({type(exc).__name__}); the "
              "next run there starts it again", file=sys.stderr)  # fmt: skip
