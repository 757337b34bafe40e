"""`zerocc train --nnodes N --node-rank I --rdzv-endpoint HOST:PORT`: a run over several
machines, tested as two launchers on this machine acting as two nodes (loopback). It trains as
the one-machine run of the same world size, and saves into a folder both see."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zerocc.cli.main import main

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _zerocc(*args: str) -> list[str]:
    return [sys.executable, "-m", "zerocc", "train", str(PLAN), "--steps", "3", *args]


def _final_loss(out: str) -> str:
    return re.search(r"final loss: (\S+)", out).group(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_launchers_as_two_nodes_train_as_one_machine_does(tmp_path):
    """Node 0 and node 1, one rank each, meet at node 0's endpoint: rank 0 (on node 0) reports
    a run of 2 ranks whose final loss is the 2-rank run's on one machine, and the checkpoint in
    the shared folder holds both ranks' files."""
    endpoint = f"127.0.0.1:{_free_port()}"
    saves = tmp_path / "shared"
    nodes = [
        subprocess.Popen(
            _zerocc(
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                endpoint,
                "--save",
                str(saves),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=CPU_ONLY,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, out in zip(nodes, outs, strict=True):
        assert node.returncode == 0, out[-3000:]
    assert "3 step(s) on 2 rank(s)" in outs[0]
    assert "final loss" not in outs[1]  # (rank 0 reports, on node 0)
    one_machine = subprocess.run(_zerocc("--nproc", "2"), capture_output=True, text=True,
                                 timeout=600, env=CPU_ONLY)  # fmt: skip
    assert one_machine.returncode == 0, one_machine.stderr[-3000:]
    assert _final_loss(outs[0]) == _final_loss(one_machine.stdout)
    manifest = json.loads((saves / "step-00000003" / "manifest.json").read_text())
    assert manifest["meta"]["world_size"] == 2
    assert sorted(manifest["files"]) == ["rank-00000.bin", "rank-00001.bin"]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
         "--node-rank 2: a node of --nnodes 2 is 0 to 1"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0': HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--master-port", "5"],
         "--master-port is for one machine"),
        (["--nnodes", "3", "--rdzv-endpoint", "h:1"], "2 ranks, which 3 machines cannot share"),
    ],
    ids=["no-endpoint", "node-rank", "endpoint", "master-port", "uneven"],
)  # fmt: skip
def test_a_multi_node_launch_that_cannot_work_is_refused_before_it_starts(flags, error, capsys):
    assert main(["train", str(PLAN), "--steps", "1", *flags]) == 2
    assert error in capsys.readouterr().err
