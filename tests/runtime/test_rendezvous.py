"""`zerocc rendezvous`: a store where a restarting run's machines meet that no training machine
holds (zerocc.runtime.rendezvous); and where a launcher keeps its own: a one-machine run's on
the loopback interface only. The train flags that meet there are tested with the lost node in
tests/cli/test_cli_multinode.py; the shared secret in tests/runtime/test_rendezvous_secret.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from zerocc.errors import ZeroccError
from zerocc.runtime import rendezvous
from zerocc.runtime.launch import _rendezvous_id, launch
from zerocc.runtime.nodes import Nodes

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def served():
    """A `zerocc rendezvous` on a free port, as its own process: (port, process)."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "zerocc", "rendezvous", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said = process.stdout.readline()
    assert f"listening on {socket.getfqdn()}:{port}" in said, said
    yield port, process
    if process.poll() is None:
        process.kill()
        process.wait()


def test_a_rendezvous_answers_numbers_its_runs_and_stops_on_sigterm(served):
    port, process = served
    assert rendezvous.answers("127.0.0.1", port)
    rendezvous.wait_for("127.0.0.1", port, timeout=5)
    assert rendezvous.run_id("127.0.0.1", port, "job") == "job.0"
    rendezvous.ended("127.0.0.1", port, "job")
    rendezvous.ended("127.0.0.1", port, "job")  # (each machine's launcher counts its end)
    assert rendezvous.run_id("127.0.0.1", port, "job") == "job.2"
    assert rendezvous.run_id("127.0.0.1", port, "other") == "other.0"
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert "stopped by SIGTERM" in out


def test_only_a_zerocc_rendezvous_answers():
    with socket.socket() as listening:  # (something else listens: it is not a rendezvous)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert not rendezvous.answers("127.0.0.1", listening.getsockname()[1], timeout=1)
    assert not rendezvous.answers("127.0.0.1", _free_port())  # (nothing listens)


def test_a_standalone_run_with_no_rendezvous_says_where_it_looked():
    port = _free_port()
    said = (f"no `zerocc rendezvous` answers at 127.0.0.1:{port} after 1 s; start `zerocc "
            f"rendezvous --port {port}` on 127.0.0.1")  # fmt: skip
    with pytest.raises(ZeroccError, match=re.escape(said)):
        rendezvous.wait_for("127.0.0.1", port, timeout=1)


def test_a_second_rendezvous_on_a_port_in_use_is_refused(served):
    port, _ = served
    again = subprocess.run(
        [sys.executable, "-m", "zerocc", "rendezvous", "--port", str(port)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 2
    assert f"zerocc: error: cannot listen on port {port}: " in again.stderr


def test_node_0_does_not_keep_a_store_where_a_rendezvous_answers(served):
    port, _ = served
    endpoint = f"127.0.0.1:{port}"
    with pytest.raises(ZeroccError, match="pass --rdzv-standalone on every machine"):
        _rendezvous_id(Nodes(2, 0, endpoint), "127.0.0.1", port)
    assert _rendezvous_id(Nodes(2, 1, endpoint), "127.0.0.1", port) == f"zerocc-{port}"
    standalone = Nodes(2, 0, endpoint, standalone=True, name="job")
    assert _rendezvous_id(standalone, "127.0.0.1", port) == "job.0"


def listening_addresses(port: int) -> set[str]:
    """The addresses something on this machine listens on at ``port``, read from
    /proc/net/tcp and tcp6 (``0.0.0.0`` and ``::`` are every address)."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, number = local.partition(":")
            if state != "0A" or int(number, 16) != port:  # (0A: LISTEN)
                continue
            # (the kernel prints each 32-bit word of the address in host byte order)
            words = bytes.fromhex(address)
            raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
            found.add(socket.inet_ntop(family, raw))
    return found


def test_a_one_machine_launch_keeps_its_store_on_the_loopback_interface_only():
    """A launch of 2 local ranks (each checking the example plan): while it runs, its store,
    torchrun's agent's, listens on 127.0.0.1 and no other address (it listened on every
    address, ``*:PORT``: torch's TCPStore binds all, whatever host it is given)."""
    port = _free_port()
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            seen.update(listening_addresses(port))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ended = launch(2, port, ["plan", "check", str(PLAN)])
    finally:
        done.set()
        watcher.join()
    assert ended.status == 0
    assert seen == {"127.0.0.1"}


def test_a_one_machine_run_keeps_its_ranks_gloo_on_the_loopback_interface(monkeypatch):
    """The ranks inherit GLOO_SOCKET_IFNAME=lo from a one-machine launch (gloo listened on the
    address the hostname resolves to, which on most machines is the network's); a value the
    user set is kept, and the variable is gone again after the run."""
    monkeypatch.delenv(rendezvous.GLOO_INTERFACE, raising=False)
    with rendezvous.meeting_place(Nodes(), "127.0.0.1", _free_port()):
        assert os.environ[rendezvous.GLOO_INTERFACE] == "lo"
    assert rendezvous.GLOO_INTERFACE not in os.environ
    monkeypatch.setenv(rendezvous.GLOO_INTERFACE, "eth7")
    with rendezvous.meeting_place(Nodes(), "127.0.0.1", _free_port()):
        assert os.environ[rendezvous.GLOO_INTERFACE] == "eth7"


def test_a_one_machine_store_on_a_port_in_use_is_refused_by_name():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ZeroccError, match=re.escape(
            f"cannot keep the rendezvous store on 127.0.0.1:{port}: Address already in use; "
            "pass another --master-port (0: a free one)"
        )):  # fmt: skip
            with rendezvous.meeting_place(Nodes(), "127.0.0.1", port):
                pass


def test_node_0_of_several_keeps_its_store_on_every_address():
    """The machines meet at node 0's store: it listens on every address (torch's own), which
    the shared secret and docs/gpus.md's firewall note are for."""
    port = _free_port()
    with rendezvous.meeting_place(Nodes(2, 0, f"127.0.0.1:{port}"), "127.0.0.1", port):
        assert listening_addresses(port) & {"0.0.0.0", "::"}
    assert not listening_addresses(port)


def test_a_node_that_finds_no_zerocc_store_at_the_endpoint_says_so(monkeypatch):
    """Node 1 checks node 0's store for the secret's key before it joins: where nothing
    listens, or a store that is not a zerocc launcher's, it ends naming the endpoint once
    its wait is over (600 s; 2 here)."""
    monkeypatch.setattr(rendezvous, "JOIN_TIMEOUT_S", 2.0)
    from torch.distributed import TCPStore

    other = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for port in (_free_port(), other.port):
        said = (f"no zerocc launcher keeps a store at --rdzv-endpoint 127.0.0.1:{port} after "
                "2 s: start node 0")  # fmt: skip
        with pytest.raises(ZeroccError, match=re.escape(said)):
            with rendezvous.meeting_place(Nodes(2, 1, f"127.0.0.1:{port}"), "127.0.0.1", port):
                pass
