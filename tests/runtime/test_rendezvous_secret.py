"""The shared secret of a run over several machines (zerocc.runtime.rendezvous_secret): a
launcher without it, or with another, is refused by name before it joins the store the
machines meet at; with the right one it joins. Two real launchers refused and joined:
tests/cli/test_cli_multinode.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from zerocc.errors import ZeroccError
from zerocc.runtime import rendezvous, rendezvous_secret
from zerocc.runtime.nodes import Nodes
from zerocc.runtime.rendezvous_secret import SECRET_ENV, SECRET_FILE_ENV

MISSING = "asks for the run's shared secret, and this launcher has none: set ZEROCC_RDZV_SECRET"
WRONG = "was started with another shared secret than this launcher's ZEROCC_RDZV_SECRET"
UNEXPECTED = "was started without a shared secret, and this launcher has one (ZEROCC_RDZV_SECRET"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def no_secret(monkeypatch):
    """Neither variable set, whatever this machine's environment holds."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def _join(monkeypatch, node_0_secret: str | None, own_secret: str | None) -> None:
    """Node 0 keeps its store with ``node_0_secret``; node 1, with ``own_secret``, checks it
    as it does before it joins."""
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    if node_0_secret is not None:
        monkeypatch.setenv(SECRET_ENV, node_0_secret)
    with rendezvous.meeting_place(Nodes(2, 0, endpoint), "127.0.0.1", port):
        monkeypatch.delenv(SECRET_ENV, raising=False)
        if own_secret is not None:
            monkeypatch.setenv(SECRET_ENV, own_secret)
        with rendezvous.meeting_place(Nodes(2, 1, endpoint), "127.0.0.1", port):
            pass


@pytest.mark.parametrize(("node_0", "own"), [("s3cret", "s3cret"), (None, None)])
def test_a_launcher_with_the_stores_secret_joins(node_0, own, monkeypatch):
    _join(monkeypatch, node_0, own)


@pytest.mark.parametrize(
    ("node_0", "own", "error"),
    [("s3cret", None, MISSING), ("s3cret", "guess", WRONG), (None, "s3cret", UNEXPECTED)],
    ids=["missing", "wrong", "store-has-none"],
)
def test_a_launcher_without_the_stores_secret_is_refused_by_name(node_0, own, error, monkeypatch):
    with pytest.raises(ZeroccError, match=re.escape(error)) as refused:
        _join(monkeypatch, node_0, own)
    assert str(refused.value).startswith("node 0's store at --rdzv-endpoint 127.0.0.1:")


def test_the_secret_never_travels(monkeypatch):
    """What the store holds is a nonce and its HMAC, not the secret; a fresh nonce each time."""
    port = _free_port()
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    held = []
    for _ in range(2):
        with rendezvous.meeting_place(Nodes(2, 0, f"127.0.0.1:{port}"), "127.0.0.1", port):
            held.append(rendezvous._store("127.0.0.1", port, 10).get(rendezvous_secret.SECRET_KEY))
    assert all(b"s3cret" not in value for value in held)
    assert held[0] != held[1]


def test_the_secret_may_be_read_from_a_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert rendezvous_secret.shared_secret() == b"s3cret"
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    with pytest.raises(ZeroccError, match="ZEROCC_RDZV_SECRET and ZEROCC_RDZV_SECRET_FILE are "
                       "both set: set one of them"):  # fmt: skip
        rendezvous_secret.shared_secret()


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [(SECRET_ENV, "", "ZEROCC_RDZV_SECRET is set but empty"),
     (SECRET_FILE_ENV, "/nonexistent/secret",
      "ZEROCC_RDZV_SECRET_FILE=/nonexistent/secret: cannot read it: No such file or directory")],
    ids=["empty", "no-file"],
)  # fmt: skip
def test_a_secret_that_cannot_be_had_is_refused_by_name(variable, value, error, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ZeroccError, match=re.escape(error)):
        rendezvous_secret.shared_secret()


def test_a_standalone_rendezvous_refuses_a_node_without_its_secret(monkeypatch):
    """`zerocc rendezvous` started with a secret: a node with it joins, one without it is
    refused as it checks that the rendezvous answers."""
    port = _free_port()
    served = subprocess.Popen(
        [sys.executable, "-m", "zerocc", "rendezvous", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, SECRET_ENV: "s3cret"},
    )  # fmt: skip
    try:
        said = served.stdout.readline()
        assert f":{port} (shared secret: ZEROCC_RDZV_SECRET);" in said, said
        with pytest.raises(ZeroccError, match=re.escape(
            f"the `zerocc rendezvous` at 127.0.0.1:{port} {MISSING}"
        )):  # fmt: skip
            rendezvous.wait_for("127.0.0.1", port, timeout=10)
        monkeypatch.setenv(SECRET_ENV, "s3cret")
        rendezvous.wait_for("127.0.0.1", port, timeout=10)
    finally:
        served.kill()
        served.wait()
