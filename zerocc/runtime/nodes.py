"""The machines a run spans, by torchrun's names (:class:`Nodes`): how many, which one this
launcher is, where they meet and how that meeting is set, checked as the flags give them."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from zerocc.errors import ZeroccError

# What `--rdzv-conf` may set of torchrun's c10d rendezvous, and its default (``is_host`` is
# zerocc's: node 0 keeps the store).
RENDEZVOUS_CONF = {
    "join_timeout": "seconds the nodes have to meet (600)",
    "last_call_timeout": "seconds a round waits for more nodes once enough have met (30)",
    "close_timeout": "seconds a round has to close (30)",
    "heartbeat_timeout": "seconds a keep-alive may take",
    "keep_alive_interval": "seconds between a node's keep-alives (5)",
    "keep_alive_max_attempt": "keep-alives missed before a node counts as lost (3)",
    "read_timeout": "seconds a read of the store may take (60)",
}


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit among the run's machines, by torchrun's names: node
    ``rank`` of ``count``, meeting at ``endpoint`` (``HOST:PORT`` of node 0, where its
    launcher keeps the store the ranks rendezvous at). Global ranks are node-major: node
    ``i``'s ``nproc`` ranks are ``i × nproc`` onwards (torchrun's static rendezvous); a run
    that restarts (``--max-restarts``) meets at torchrun's c10d rendezvous instead, where a node
    that replaces a lost one joins the next round, and ranks go by the order the nodes join;
    ``conf`` sets that rendezvous (``KEY=VALUE,...`` of :data:`RENDEZVOUS_CONF`: a lost node
    counts as lost after ``keep_alive_interval × keep_alive_max_attempt`` seconds, 15 by
    default). ``standalone``: the endpoint is a `zerocc rendezvous` of its own
    (:mod:`zerocc.runtime.rendezvous`), which no node holds, so node 0 may be lost too; ``name``
    is the run's there (torchrun's ``--rdzv-id``, ``zerocc-PORT`` by default). ``least``: the
    fewest machines the run goes on with (``--nnodes MIN:N``), once one is lost and not
    replaced (:attr:`fewest`: ``count`` where None)."""

    count: int = 1
    rank: int = 0
    endpoint: str | None = None
    conf: str | None = None
    standalone: bool = False
    name: str | None = None
    least: int | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ZeroccError(f"--nnodes {self.count}: at least 1")
        if not 1 <= self.fewest <= self.count:
            raise ZeroccError(f"--nnodes {self.fewest}:{self.count}: MIN from 1 to {self.count}")
        if not 0 <= self.rank < self.count:
            raise ZeroccError(
                f"--node-rank {self.rank}: a node of --nnodes {self.count} is 0 to {self.count - 1}"
            )
        if self.count > 1 and self.endpoint is None:
            raise ZeroccError(
                f"--nnodes {self.count} needs --rdzv-endpoint HOST:PORT: node 0's address and a "
                "free port on it, the same on every node"
            )
        if self.endpoint is not None:
            self.address()  # (checked now)
        if self.conf is not None:
            self.rendezvous_conf()  # (checked now)
        if self.name is not None and not re.fullmatch(r"[\w.-]+", self.name):
            raise ZeroccError(f"--rdzv-id {self.name!r}: letters, digits, '_', '.' and '-' only")

    def rendezvous_conf(self) -> str:
        """torchrun's ``--rdzv-conf`` for the c10d rendezvous: node 0 hosts the store, and
        what ``conf`` sets (each key one of :data:`RENDEZVOUS_CONF`, each value a positive
        integer)."""
        items = [f"is_host={str(self.rank == 0 and not self.standalone).lower()}"]
        for item in self.conf.split(",") if self.conf else []:
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in RENDEZVOUS_CONF:
                known = "; ".join(f"{k}: {what}" for k, what in RENDEZVOUS_CONF.items())
                why = " (zerocc sets is_host: node 0 keeps the store)" if key == "is_host" else ""
                raise ZeroccError(
                    f"--rdzv-conf {self.conf!r}: {key!r} is not a setting zerocc passes on{why}; "
                    f"known: {known}"
                )
            if not value.strip().isdigit() or int(value) < 1:
                raise ZeroccError(f"--rdzv-conf {self.conf!r}: {key} is {value!r}, not a whole "
                                  "number of at least 1")  # fmt: skip
            items.append(f"{key}={int(value)}")
        return ",".join(items)

    @property
    def fewest(self) -> int:
        """The fewest machines the run goes on with: ``least``, else ``count``."""
        return self.count if self.least is None else self.least

    def run_name(self, port: int) -> str:
        """The run's name at its rendezvous on ``port``: ``name``, else ``zerocc-PORT``."""
        return self.name or f"zerocc-{port}"

    def address(self, port: int = 0) -> tuple[str, int]:
        """The rendezvous host and port: the endpoint's, else this machine and ``port``."""
        if self.endpoint is None:
            return "127.0.0.1", port
        host, _, number = self.endpoint.rpartition(":")
        if not host or not number.isdigit() or not 0 < int(number) < 65536:
            raise ZeroccError(
                f"--rdzv-endpoint {self.endpoint!r}: HOST:PORT, a port from 1 to 65535 "
                "(e.g. node0.cluster:29500)"
            )
        return host.strip("[]"), int(number)

    def store_elsewhere(self) -> str | None:
        """A note where this launcher is to keep the store the machines meet at (node 0, not
        at a `zerocc rendezvous`) but the endpoint's host is not this machine: every machine
        started as node 0 (``--node-rank`` forgotten) would wait for the others forever. None
        where it is, or nothing is kept. A note, not an error: a host reached through NAT
        names this machine by an address it cannot see."""
        if self.count == 1 or self.rank != 0 or self.standalone:
            return None
        host, _ = self.address()
        if _names_this_machine(host):
            return None
        return (
            f"zerocc: note: this machine ({socket.gethostname()}) is node 0 (--node-rank 0), "
            f"which keeps the store the machines meet at --rdzv-endpoint {self.endpoint}, but "
            f"{host} is not an address of this machine: where it is another one, start node 0 "
            f"there and this one with its own --node-rank (1 to {self.count - 1}), or the "
            "machines wait for each other in vain"
        )


def _names_this_machine(host: str) -> bool:
    """Whether ``host`` is an address of this machine (one it resolves to can be bound here);
    True where it does not resolve (torchrun says so itself)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return True
    for family, _, _, _, address in found:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False
