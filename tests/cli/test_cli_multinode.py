"""`zerocc train --nnodes N --node-rank I --rdzv-endpoint HOST:PORT`: a run over several
machines, tested as two launchers on this machine acting as two nodes (loopback). It trains as
the one-machine run of the same world size, and saves into a folder both see."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from lost_node_workload import LOSE_THIS_NODE
from torch.distributed import TCPStore
from train_runs import CPU_ONLY, checkpoint_digests, final_loss

from zerocc.cli.machines import nodes_of
from zerocc.cli.main import _parser, main
from zerocc.runtime.launch import RUN_DIR_ENV, started_before
from zerocc.runtime.nodes import Nodes
from zerocc.runtime.rendezvous_secret import SECRET_ENV, SECRET_FILE_ENV

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"


def _zerocc(*args: str) -> list[str]:
    """The train command; ``--steps 3`` unless ``args`` say how many."""
    steps = [] if "--steps" in args else ["--steps", "3"]
    return [sys.executable, "-m", "zerocc", "train", str(PLAN), *steps, *args]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_launchers_as_two_nodes_train_as_one_machine_does(tmp_path):
    """Node 0 and node 1, one rank each, meet at node 0's endpoint (with the run's shared
    secret, ZEROCC_RDZV_SECRET): rank 0 (on node 0) reports a run of 2 ranks whose final loss
    is the 2-rank run's on one machine, and the checkpoint in the shared folder holds both
    ranks' files."""
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
            env={**CPU_ONLY, SECRET_ENV: "s3cret"},
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
    assert final_loss(outs[0]) == final_loss(one_machine.stdout)
    manifest = json.loads((saves / "step-00000003" / "manifest.json").read_text())
    assert manifest["meta"]["world_size"] == 2
    assert sorted(manifest["files"]) == ["rank-00000.bin", "rank-00001.bin"]


def test_a_node_without_the_runs_secret_is_refused_before_it_joins():
    """Node 0 keeps its store with the run's shared secret: node 1 started without it, then
    with another, ends at once (2) with an error naming ZEROCC_RDZV_SECRET, each time before
    it joins (node 0 still waits for its peer)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    flags = ("--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint)
    node_0 = subprocess.Popen(
        _zerocc(*flags, "--node-rank", "0"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**CPU_ONLY, SECRET_ENV: "s3cret"},
    )  # fmt: skip
    try:
        for secret, said in [
            (None, "asks for the run's shared secret, and this launcher has none: set "
                   "ZEROCC_RDZV_SECRET"),
            ("guess", "was started with another shared secret than this launcher's "
                      "ZEROCC_RDZV_SECRET"),
        ]:  # fmt: skip
            env = {k: v for k, v in CPU_ONLY.items() if k != SECRET_ENV}
            node_1 = subprocess.run(
                _zerocc(*flags, "--node-rank", "1"), capture_output=True, text=True,
                timeout=300, env=env if secret is None else {**env, SECRET_ENV: secret},
            )  # fmt: skip
            assert node_1.returncode == 2, node_1.stderr[-3000:]
            assert f"zerocc: error: node 0's store at --rdzv-endpoint {endpoint} {said}" \
                in node_1.stderr, node_1.stderr[-3000:]  # fmt: skip
            assert "Traceback" not in node_1.stderr
            assert node_0.poll() is None  # (still waiting for its peer)
    finally:
        node_0.kill()
        node_0.wait()


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
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "keep_alive_interval=1"],
         "--rdzv-conf sets the rendezvous of a run that restarts"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/tmp/x",
          "--rdzv-conf", "keep_alive_intervl=1"],
         "'keep_alive_intervl' is not a setting zerocc passes on; known: join_timeout"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/tmp/x",
          "--rdzv-conf", "is_host=true"], "(zerocc sets is_host: node 0 keeps the store)"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-standalone"],
         "--rdzv-standalone sets the rendezvous of a run that restarts"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "a"],
         "--rdzv-id sets the rendezvous of a run that restarts"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/tmp/x",
          "--rdzv-id", "job 7"], "--rdzv-id 'job 7': letters, digits"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/tmp/x",
          "--rdzv-conf", "keep_alive_interval=0.5"],
         "keep_alive_interval is '0.5', not a whole number of at least 1"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"],
         "--nnodes 1:2 goes on with fewer machines after a restart: it goes with --max-restarts"),
        (["--nnodes", "3:2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/x"],
         "--nnodes 3:2: MIN from 1 to 2"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/x",
          "--set", "zero.world_size=2"], "zero.world_size: 2 fixes the ranks"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--save", "/x",
          "--nproc", "1", "--set", "zero.replicate=2"],
         "--nnodes 1:2: on 1 machine(s) the run would have 1 ranks, which the plan's layout "
         "cannot take"),
    ],
    ids=["no-endpoint", "node-rank", "endpoint", "master-port", "uneven", "conf-static",
         "conf-unknown", "conf-is-host", "standalone-fixed", "id-fixed", "id-spaces",
         "conf-value", "fewer-fixed", "fewer-min", "fewer-world-size", "fewer-layout"],
)  # fmt: skip
def test_a_multi_node_launch_that_cannot_work_is_refused_before_it_starts(flags, error, capsys):
    assert main(["train", str(PLAN), "--steps", "1", *flags]) == 2
    assert error in capsys.readouterr().err


def test_a_secret_file_that_cannot_be_read_is_said_before_the_launch(monkeypatch, capsys):
    monkeypatch.setenv(SECRET_FILE_ENV, "/nonexistent/secret")
    assert main(["train", str(PLAN), "--steps", "1", "--nnodes", "2", "--rdzv-endpoint",
                 "h:1"]) == 2  # fmt: skip
    said = "ZEROCC_RDZV_SECRET_FILE=/nonexistent/secret: cannot read it: No such file"
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("value", ["a:2", "1:", "1:2:3", "-1"])
def test_nnodes_is_a_count_or_a_range(value, capsys):
    with pytest.raises(SystemExit):
        main(["train", str(PLAN), "--nnodes", value])
    assert f"argument --nnodes: {value!r}: N or MIN:N, whole numbers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "slurm", "rank"),
    [([], {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, 1),  # srun, one task per machine
     (["--node-rank", "0"], {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, 0),  # given: kept
     ([], {"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, 0),  # tasks are not machines
     ([], {}, 0)],
    ids=["srun", "given", "tasks-per-machine", "no-slurm"],
)  # fmt: skip
def test_the_node_rank_defaults_to_slurms_task_under_srun(flags, slurm, rank, monkeypatch):
    for name in ("SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    args = _parser().parse_args(["train", str(PLAN), "--nnodes", "2", "--rdzv-endpoint", "h:1",
                                 *flags])  # fmt: skip
    assert nodes_of(args).rank == rank


def test_a_rank_its_launch_started_before_counts_as_restarted(tmp_path, monkeypatch):
    """(torchrun starts a round after the machines changed without counting a restart.)"""
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    for before in (False, True):
        started_before.cache_clear()  # (a new process of local rank 1)
        assert started_before() is before
    monkeypatch.setenv("LOCAL_RANK", "0")
    started_before.cache_clear()
    assert not started_before()  # (another local rank's first start)
    started_before.cache_clear()


def test_the_rendezvous_settings_go_to_torchrun_beside_zeroccs_own():
    conf = "keep_alive_interval=2, keep_alive_max_attempt=3"
    assert Nodes(2, 0, "h:1", conf).rendezvous_conf() == (
        "is_host=true,keep_alive_interval=2,keep_alive_max_attempt=3"
    )
    assert Nodes(2, 1, "h:1").rendezvous_conf() == "is_host=false"
    assert Nodes(2, 0, "h:1", standalone=True).rendezvous_conf() == "is_host=false"


def test_node_0_on_a_machine_that_is_not_the_endpoints_host_is_told_so():
    """Node 0 keeps the store at the endpoint's host: started elsewhere (every machine left at
    the default --node-rank 0), the launcher says so before it waits. 192.0.2.1 is reserved
    for documentation (RFC 5737): no machine has it."""
    elsewhere = Nodes(2, 0, "192.0.2.1:29500").store_elsewhere()
    assert elsewhere is not None
    assert "is node 0 (--node-rank 0)" in elsewhere and "192.0.2.1 is not an address" in elsewhere
    assert "its own --node-rank (1 to 1)" in elsewhere
    for here in (Nodes(2, 0, "127.0.0.1:29500"), Nodes(2, 0, f"{socket.gethostname()}:1"),
                 Nodes(2, 1, "192.0.2.1:29500"),  # (node 1 keeps nothing)
                 Nodes(2, 0, "192.0.2.1:29500", standalone=True), Nodes()):  # fmt: skip
        assert here.store_elsewhere() is None, here


# (from disk: the restart of test_cli_checkpoint.py's from-disk case, on c10d: slow)
@pytest.mark.parametrize(
    ("in_memory", "standalone"),
    [pytest.param(False, False, marks=pytest.mark.slow), (True, False), (True, True)],
    ids=["from-disk", "in-memory", "node-0-at-a-standalone-rendezvous"],
)
def test_a_lost_node_is_replaced_and_the_run_goes_on(tmp_path, in_memory, standalone):
    """`--max-restarts 1` over two nodes meets at torchrun's c10d rendezvous. Node 1 is lost
    at its rank's 6th batch (after step 5, saved every 2 steps): its memory is cleared, its
    launcher and its rank are killed by SIGKILL. Node 0's rank fails on its next collective
    and, restarted, waits for the run's second node; a new launcher, node 1's replacement,
    joins, and both ranks start again (the replacement's at restart 0, its peer's at 1: they
    agree) from step 4 of the shared folder, or with `checkpoint.in_memory` from memory: node
    0 kept a copy of node 1's rank's state, which the replacement receives. That is step 5's
    where its copies (on a thread) were through before the loss, else step 4's: the loss comes
    right after step 5's save returned. The final checkpoint is the uninterrupted run's, every
    tensor bit for bit.

    At a `zerocc rendezvous` (``--rdzv-standalone``) node 0 is the one lost, whose launcher
    would otherwise keep the store: the run goes on all the same. The uninterrupted run then
    meets at the same rendezvous, as the next run under the same name (two nodes there too)."""
    import yaml

    plan = yaml.safe_load(PLAN.read_text())
    plan["workload"] = f"{Path(__file__).parent / 'lost_node_workload.py'}:workload"
    plan["workload_args"]["kill_at"] = 5
    losing = tmp_path / "losing.yaml"
    losing.write_text(yaml.safe_dump(plan))
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    saves = tmp_path / "shared"
    train = [sys.executable, "-m", "zerocc", "train", str(losing), "--steps", "8",
             "--save-every", "2", "--max-restarts", "1"]  # fmt: skip
    memory = ["--set", "checkpoint.in_memory=true"] if in_memory else []
    meeting = ["--rdzv-standalone"] if standalone else []
    lost_rank = 0 if standalone else 1

    one_thread = {**CPU_ONLY, "OMP_NUM_THREADS": "1"}  # (as the 2 ranks of one machine have)

    def node(rank: int, save: Path, lose: bool = False) -> subprocess.Popen:
        # (a lost node counts as lost after 3 keep-alives 2 s apart, not torchrun's 3 × 5 s)
        command = [*train, "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
                   "--rdzv-endpoint", endpoint, "--save", str(save), *memory, *meeting,
                   "--rdzv-conf", "keep_alive_interval=2,keep_alive_max_attempt=3"]  # fmt: skip
        env = {**one_thread, LOSE_THIS_NODE: "1"} if lose else one_thread
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)  # fmt: skip

    store = None
    if standalone:
        store = subprocess.Popen([sys.executable, "-m", "zerocc", "rendezvous", "--port",
                                  str(port)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert "listening on" in store.stdout.readline()
    try:
        nodes = {rank: node(rank, saves, lose=rank == lost_rank) for rank in (0, 1)}
        lost = nodes[lost_rank]
        lost.communicate(timeout=600)
        assert lost.returncode == -signal.SIGKILL
        nodes[lost_rank] = node(lost_rank, saves)  # (the replacement)
        outs = [p.communicate(timeout=600)[0] for p in nodes.values()]
        for process, out in zip(nodes.values(), outs, strict=True):
            assert process.returncode == 0, out[-3000:]
        said = "".join(outs)
        if in_memory:
            start = re.search(r"starts again from step ([45]) in memory \((\S+); 1 rank\(s\) "
                              r"from a peer's copy\)", said)  # fmt: skip
            assert start, said[-3000:]
            assert f"resumed from memory at micro-batch {start.group(1)}" in said, said[-3000:]
            copied = "checkpoints in memory: every step, each copied to the next machine on a "
            assert copied in said
            assert not Path(start.group(2)).exists()  # (the launcher removed it at the end)
        else:
            assert f"every rank starts again from {saves / 'step-00000004'}" in said, said[-3000:]
        plan["workload_args"]["kill_at"] = 10**6  # never
        losing.write_text(yaml.safe_dump(plan))
        straight = tmp_path / "straight"
        if standalone:  # (the next run at the same rendezvous, under the same name)
            twice = [node(rank, straight) for rank in (0, 1)]
            for process in twice:
                out = process.communicate(timeout=600)[0]
                assert process.returncode == 0, out[-3000:]
        else:
            whole = subprocess.run([*train, "--nproc", "2", "--save", str(straight)],
                                   capture_output=True, text=True, timeout=600,
                                   env=one_thread)  # fmt: skip
            assert whole.returncode == 0, whole.stderr[-3000:]
    finally:
        if store is not None:
            store.terminate()
            store.wait(timeout=30)
    last = "step-00000008"
    assert checkpoint_digests(saves / last) == checkpoint_digests(straight / last)


def test_a_node_waiting_for_the_others_says_so():
    """Node 0 of 2 started alone (its peer never comes): its launcher says where it waits and
    what the other machines must run, instead of torchrun's silence."""
    alone = subprocess.Popen(
        _zerocc("--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=CPU_ONLY,
    )  # fmt: skip
    give_up = threading.Timer(120, alone.kill)  # (the notice is due after 10 s)
    give_up.start()
    try:
        said = next((line for line in alone.stderr if line.startswith("zerocc: waiting")), "")
    finally:
        give_up.cancel()
        alone.kill()
        alone.wait()
    assert said.startswith("zerocc: waiting at 127.0.0.1:"), said
    assert "for the run's other machines (--nnodes 2: each starts `zerocc train` with the same " \
           "plan and flags, and its own --node-rank); 10 s so far" in said  # fmt: skip


def test_a_node_whose_rendezvous_is_gone_says_so_and_ends(tmp_path):
    """A node waits at a `zerocc rendezvous` for the run's second node, and the rendezvous is
    killed: the node's launcher ends (2) naming the rendezvous, not with torch's traceback."""
    port = _free_port()
    store = subprocess.Popen([sys.executable, "-m", "zerocc", "rendezvous", "--port", str(port)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "listening on" in store.stdout.readline()
        waiting = subprocess.Popen(
            _zerocc("--nproc", "1", "--nnodes", "2", "--max-restarts", "1", "--rdzv-standalone",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--save", str(tmp_path)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CPU_ONLY,
        )  # fmt: skip
        joined = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        deadline = time.monotonic() + 120
        while not joined.check([f"torch.rendezvous.zerocc-{port}.0"]):  # (its join's state)
            assert time.monotonic() < deadline and waiting.poll() is None, waiting.stdout.read()
            time.sleep(0.5)
    finally:
        store.kill()
        store.wait()
    out = waiting.communicate(timeout=120)[0]
    assert waiting.returncode == 2, out[-3000:]
    assert f"zerocc: the rendezvous at 127.0.0.1:{port} is gone, which ends the run: the " \
           "`zerocc rendezvous` there stopped" in out  # fmt: skip
    assert "Traceback" not in out


def test_a_rendezvous_lost_mid_run_stops_the_ranks_where_they_can_resume(tmp_path):
    """Two nodes train at a `zerocc rendezvous`, which is killed once step 2 is saved: every
    rank stops at the end of its step and saves it (as on SIGTERM), and both launchers end (2)
    naming the rendezvous. The run goes on from that save with --resume."""
    port = _free_port()
    store = subprocess.Popen([sys.executable, "-m", "zerocc", "rendezvous", "--port", str(port)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    saves = tmp_path / "shared"
    try:
        assert "listening on" in store.stdout.readline()
        nodes = [
            subprocess.Popen(
                _zerocc("--steps", "1000", "--nproc", "1", "--nnodes", "2", "--node-rank",
                        str(rank), "--max-restarts", "1", "--rdzv-standalone", "--rdzv-endpoint",
                        f"127.0.0.1:{port}", "--save", str(saves), "--save-every", "2"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CPU_ONLY,
            )  # fmt: skip
            for rank in (0, 1)
        ]
        deadline = time.monotonic() + 300
        while not (saves / "step-00000002").exists():
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes)
            time.sleep(0.2)
    finally:
        store.kill()
        store.wait()
    outs = [node.communicate(timeout=120)[0] for node in nodes]
    for node, out in zip(nodes, outs, strict=True):
        assert node.returncode == 2, out[-3000:]
        assert f"the rendezvous at 127.0.0.1:{port} is gone, which ends the run" in out
    stopped = re.search(r"stopped by SIGTERM after micro-batch (\d+): (\S+);", "".join(outs))
    assert stopped, outs[0][-3000:]
    assert int(stopped.group(1)) < 1000 and Path(stopped.group(2)).is_dir()


def test_a_lost_node_not_replaced_leaves_the_run_on_fewer_machines(tmp_path):
    """`--nnodes 1:2` with `checkpoint.in_memory`: node 1 is lost at its rank's 7th batch
    (after step 6; saved on disk every 4 steps) and nobody replaces it. Node 0's rank,
    restarted, meets alone once the rendezvous's last call is over. Its machine's memory
    holds both ranks' states of step 5 or 6 (its own, and its copy of node 1's: step 6's
    where its copies, on a thread, were through before the loss; step 6's save waited for
    step 5's), newer than the disk's step 4: they are written out as a checkpoint of the
    shared folder, from which the rank resumes, resharded from 2 ranks to 1. The final
    checkpoint is that of a run of 2 ranks to that step resumed on 1 rank, bit for bit. (The
    first round waits the same last call, 15 s, for the second node, which the two launchers
    started together meet.)"""
    import yaml

    plan = yaml.safe_load(PLAN.read_text())
    plan["workload"] = f"{Path(__file__).parent / 'lost_node_workload.py'}:workload"
    plan["workload_args"]["kill_at"] = 6
    losing = tmp_path / "losing.yaml"
    losing.write_text(yaml.safe_dump(plan))
    saves = tmp_path / "shared"
    one_thread = {**CPU_ONLY, "OMP_NUM_THREADS": "1"}
    train = [sys.executable, "-m", "zerocc", "train", str(losing), "--steps", "8"]
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [*train, "--save-every", "4", "--max-restarts", "1", "--nproc", "1", "--nnodes",
             "1:2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--save", str(saves),
             "--set", "checkpoint.in_memory=true",
             "--rdzv-conf", "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=15"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**one_thread, LOSE_THIS_NODE: "1"} if rank else one_thread,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=600)[0] for node in nodes]
    assert nodes[1].returncode == -signal.SIGKILL
    assert nodes[0].returncode == 0, outs[0][-3000:]
    written = re.search(r"the snapshots of step ([56]) in memory are of 2 ranks, not 1: written "
                        r"out to (\S+) to load resharded", outs[0])  # fmt: skip
    assert written, outs[0][-3000:]
    resumed = int(written.group(1))
    assert written.group(2) == str(saves / f"step-{resumed:08d}")
    assert f"every rank starts again from {written.group(2)}" in outs[0], outs[0][-3000:]
    assert f"{8 - resumed} step(s) on 1 rank(s)" in outs[0], outs[0][-3000:]

    plan["workload_args"]["kill_at"] = 10**6  # never
    losing.write_text(yaml.safe_dump(plan))
    before, after = tmp_path / "two", tmp_path / "one"
    for command in ([*train[:-1], str(resumed), "--nproc", "2", "--save", str(before)],
                    [*train, "--nproc", "1", "--save", str(after), "--resume",
                     str(before / f"step-{resumed:08d}")]):  # fmt: skip
        ran = subprocess.run(command, capture_output=True, text=True, timeout=600, env=one_thread)
        assert ran.returncode == 0, ran.stderr[-3000:]
    last = "step-00000008"
    assert checkpoint_digests(saves / last) == checkpoint_digests(after / last)


@pytest.mark.slow
def test_a_machine_joining_a_smaller_run_resumes_it_on_more_ranks(tmp_path):
    """`--nnodes 1:2` with node 1 late: node 0 meets alone once the last call (1 s) is over
    and trains on 1 rank. Node 1 starts once that run has saved step 4; torchrun then starts a
    round of both without counting a restart (each rank at restart 0): node 0's rank, which its
    launch started before, counts as restarted, so the ranks stop, save, and resume on 2 ranks
    from that save rather than from the beginning. The final checkpoint is that of a run of 1
    rank to the step resumed from, resumed on 2 ranks, bit for bit."""
    saves = tmp_path / "shared"
    one_thread = {**CPU_ONLY, "OMP_NUM_THREADS": "1"}
    train = [sys.executable, "-m", "zerocc", "train", str(PLAN)]
    endpoint = f"127.0.0.1:{_free_port()}"

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [*train, "--steps", "300", "--save-every", "2", "--max-restarts", "1", "--nproc", "1",
             "--nnodes", "1:2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--save",
             str(saves), "--rdzv-conf", "last_call_timeout=1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=one_thread,
        )  # fmt: skip

    alone = node(0)
    deadline = time.monotonic() + 300
    while not (saves / "step-00000004").exists():
        assert time.monotonic() < deadline and alone.poll() is None, alone.stdout.read()
        time.sleep(0.2)
    late = node(1)
    outs = [p.communicate(timeout=600)[0] for p in (alone, late)]
    for process, out in zip((alone, late), outs, strict=True):
        assert process.returncode == 0, out[-3000:]
    start = re.search(r"zerocc: restart 1: every rank starts again from \S+step-0*(\d+)", outs[0])
    assert start, outs[0][-3000:]
    resumed = int(start.group(1))
    assert resumed >= 4 and "on 2 rank(s)" in outs[0], outs[0][-3000:]

    before, after = tmp_path / "one", tmp_path / "two"
    for command in ([*train, "--steps", str(resumed), "--nproc", "1", "--save", str(before)],
                    [*train, "--steps", "300", "--nproc", "2", "--save", str(after), "--resume",
                     str(before / f"step-{resumed:08d}")]):  # fmt: skip
        ran = subprocess.run(command, capture_output=True, text=True, timeout=600, env=one_thread)
        assert ran.returncode == 0, ran.stderr[-3000:]
    last = "step-00000300"
    assert checkpoint_digests(saves / last) == checkpoint_digests(after / last)
