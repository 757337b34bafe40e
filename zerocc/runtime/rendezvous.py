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

Every store a launcher keeps is made here (:func:`meeting_place`): a one-machine run's on the
loopback interface only (torch's ``TCPStore`` listens on every address whatever host it is
given; it is handed a socket bound to 127.0.0.1, and torchrun's agent, asking for a store on
the same port in the same process, gets that one: ``multi_tenant``), and its ranks' gloo
connections on that interface too (``GLOO_SOCKET_IFNAME``, unless set). A store machines meet
at listens on every address, and torch's store has no authentication: the run's shared
secret (:mod:`zerocc.runtime.rendezvous_secret`) makes a launcher started without it, or
with another, stop before it joins.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

from zerocc.errors import ZeroccError
from zerocc.runtime import rendezvous_secret
from zerocc.runtime.nodes import Nodes

MARK = "zerocc/rendezvous"  # set by `zerocc rendezvous`: what a node checks it meets at
ENDED = "zerocc/ended/"  # + run name: launches ended under that name (a counter)
DEFAULT_PORT = 29500  # (torchrun's)
RENDEZVOUS_STATE = "torch.rendezvous."  # + run id: torchrun's c10d rendezvous state (its key)
JOIN_TIMEOUT_S = 600.0  # how long a node waits for node 0's store (torchrun's static rendezvous's)


def serve(port: int = DEFAULT_PORT) -> None:
    """Keep a rendezvous store on ``port`` of this machine (every address) until SIGINT or
    SIGTERM, saying where once it listens; signed with the run's shared secret where one is
    set (:mod:`zerocc.runtime.rendezvous_secret`)."""
    from torch.distributed import TCPStore

    secret = rendezvous_secret.shared_secret()
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # (taken below, not by a handler)
    try:
        store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, use_libuv=True)
    except Exception as exc:  # (torch's DistNetworkError, or a RuntimeError: port in use)
        raise ZeroccError(f"cannot listen on port {port}: {exc}") from None
    rendezvous_secret.sign(store, secret)
    store.set(MARK, "1")
    host = socket.getfqdn()
    guarded = f" (shared secret: {rendezvous_secret.SECRET_ENV})" if secret else ""
    print(f"zerocc rendezvous: listening on {host}:{port}{guarded}; start `zerocc train` on "
          f"every machine with --rdzv-endpoint {host}:{port} --rdzv-standalone (and --nnodes, "
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
    of a job may start with it); a ZeroccError naming the address when none answers, or when
    it was started with another shared secret than this launcher's."""
    deadline = time.monotonic() + timeout
    while not answers(host, port):
        if time.monotonic() > deadline:
            raise ZeroccError(
                f"--rdzv-standalone: no `zerocc rendezvous` answers at {host}:{port} after "
                f"{timeout:.0f} s; start `zerocc rendezvous --port {port}` on {host} first (or "
                "leave --rdzv-standalone out: node 0's launcher then keeps the store)"
            )
        time.sleep(1.0)
    where = f"the `zerocc rendezvous` at {host}:{port}"
    rendezvous_secret.check(_store(host, port, 10.0), rendezvous_secret.shared_secret(), where)


@contextlib.contextmanager
def meeting_place(nodes: Nodes, host: str, port: int) -> Iterator[None]:
    """The store this launcher's ranks meet at, for the body (torchrun's launch): kept here
    where this launcher is to keep it, on the loopback interface for a run on one machine and
    on every address, signed with the shared secret, for node 0 of several; else checked, as
    node 0's, to be signed with this launcher's secret before the body joins it (a
    `zerocc rendezvous` is checked as it answers: :func:`wait_for`)."""
    if nodes.count == 1:
        with _loopback_store(port), _gloo_on_loopback():
            yield
        return
    secret = rendezvous_secret.shared_secret()
    if nodes.standalone:
        yield
    elif nodes.rank == 0:
        store = _server(host, port, listen_fd=None)
        rendezvous_secret.sign(store, secret)
        yield
    else:
        where = f"node 0's store at --rdzv-endpoint {host}:{port}"
        rendezvous_secret.check(_node_0_store(host, port, JOIN_TIMEOUT_S), secret, where)
        yield


@contextlib.contextmanager
def _loopback_store(port: int) -> Iterator[None]:
    """A store on 127.0.0.1:``port`` only, for the body: the socket is bound here and handed to
    torch, whose own would listen on every address."""
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", port))
        listening.listen(socket.SOMAXCONN)
    except OSError as exc:
        listening.close()
        raise ZeroccError(
            f"cannot keep the rendezvous store on 127.0.0.1:{port}: {exc.strerror}; pass "
            "another --master-port (0: a free one)"
        ) from None
    store = _server("127.0.0.1", port, listen_fd=listening.detach())
    try:
        yield
    finally:
        del store


GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"  # the interface gloo's connections use (gloo's variable)


@contextlib.contextmanager
def _gloo_on_loopback() -> Iterator[None]:
    """The ranks' gloo connections on the loopback interface, for the body (the ranks inherit
    it): gloo listens on the address the machine's hostname resolves to otherwise, reachable
    from the network and unauthenticated, for a run no other machine takes part in. A value
    the user set is kept, and nothing set where no loopback interface is found."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)  # (Linux, macOS)
    if GLOO_INTERFACE in os.environ or loopback is None:
        yield
        return
    os.environ[GLOO_INTERFACE] = loopback
    try:
        yield
    finally:
        os.environ.pop(GLOO_INTERFACE, None)


def _server(host: str, port: int, listen_fd: int | None):
    """torch's store server on ``port`` (on ``listen_fd`` where given), shared by every store
    this process asks for on that port (torchrun's agent's among them: ``multi_tenant``)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False,
                        multi_tenant=True, master_listen_fd=listen_fd)  # fmt: skip
    except Exception as exc:  # (torch's DistNetworkError: port in use)
        raise ZeroccError(f"cannot keep the rendezvous store on port {port}: {exc}") from None


def _node_0_store(host: str, port: int, timeout: float):
    """A client of node 0's store at ``host:port`` once it listens and holds zerocc's
    secret key, waiting up to ``timeout`` seconds (node 0 may start after this node)."""
    deadline = time.monotonic() + timeout
    while not _listening(host, port, 2.0):
        if time.monotonic() > deadline:
            break
        time.sleep(1.0)
    try:
        store = _store(host, port, max(1.0, deadline - time.monotonic()))
        store.wait([rendezvous_secret.SECRET_KEY])
    except Exception:  # (torch's DistStoreError: timed out; or a DistNetworkError)
        raise ZeroccError(
            f"no zerocc launcher keeps a store at --rdzv-endpoint {host}:{port} after "
            f"{timeout:.0f} s: start node 0 (`zerocc train ... --node-rank 0`) on {host} with "
            "the same flags"
        ) from None
    return store


def run_id(host: str, port: int, name: str) -> str:
    """The name this launch meets under at the store at ``host:port``: ``NAME.K``, K the
    launches that ended under ``name`` there so far. The machines of one run agree on it: they
    all start, or a replacement joins, before any of them ends."""
    return f"{name}.{_store(host, port, 10.0).add(ENDED + name, 0)}"


def under_way(host: str, port: int, name: str) -> bool:
    """Whether a run under ``name`` meets at the `zerocc rendezvous` at ``host:port`` now
    (torchrun's rendezvous state of its ``NAME.K`` is there): a launcher started now joins
    it, as a lost node's replacement does, rather than starting a run of its own."""
    if not answers(host, port):
        return False
    store = _store(host, port, 10.0)
    return store.check([RENDEZVOUS_STATE + run_id(host, port, name)])


def ended(host: str, port: int, name: str) -> None:
    """Count a launch under ``name`` as ended (its rendezvous closed): the next run under it
    meets under a new name. A store gone by now is said, not raised: the run is over."""
    try:
        _store(host, port, 10.0).add(ENDED + name, 1)
    except Exception as exc:
        print(f"zerocc: the rendezvous at {host}:{port} is gone ({type(exc).__name__}); the "
              "next run there starts it again", file=sys.stderr)  # fmt: skip
