"""`zerocc train --save / --resume`: a run killed and resumed trains as the run that never
stopped; SIGTERM (what schedulers send before preemption) and Ctrl-C save before the ranks
exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_runs import CPU_ONLY, checkpoint_digests, final_loss

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"


def _train(*flags: str, nproc: int = 2) -> str:
    command = [sys.executable, "-m", "zerocc", "train", str(PLAN), "--nproc", str(nproc), *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    saves = tmp_path / "ckpt"
    out = _train("--steps", "4", "--save", str(saves), "--save-every", "2", "--keep", "1")
    assert sorted(p.name for p in saves.iterdir()) == ["latest", "step-00000004"]
    assert f"checkpoint: {saves / 'step-00000004'}" in out
    assert "checkpoints: 2 saved in the background, training blocked" in out  # (auto: fits)
    again = tmp_path / "again"
    resumed = _train(
        "--steps", "6", "--resume", str(saves), "--save", str(again),
        "--set", "checkpoint.async_save=false",
    )  # fmt: skip
    # (the checkpoint the folder's newest is, named)
    assert f"resumed from {saves / 'step-00000004'} at micro-batch 4" in resumed
    assert "checkpoints: 1 saved in the foreground, training blocked" in resumed
    assert (again / "latest").read_text().strip() == "step-00000006"
    assert "2 step(s) on 2 rank(s)" in resumed
    assert final_loss(resumed) == final_loss(_train("--steps", "6"))


def test_a_corrupt_checkpoint_is_said_once_not_by_every_rank(tmp_path):
    """Every rank refuses the checkpoint; the launcher prints the error once, whole, and its
    report names each rank's as the error above (issue 53: it was 4 copies of one fact)."""
    saves = tmp_path / "ckpt"
    _train("--steps", "2", "--save", str(saves))
    shard = saves / "step-00000002" / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    command = [sys.executable, "-m", "zerocc", "train", str(PLAN), "--nproc", "2",
               "--steps", "4", "--resume", str(saves)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("checksum mismatch") == 1, run.stderr
    assert run.stderr.startswith("zerocc: error: checkpoint load of "), run.stderr
    assert run.stderr.count("last error: the error above (CheckpointError)") == 2, run.stderr
    assert "local_rank" not in run.stderr  # (torchrun's own log of the failed processes)


@pytest.mark.parametrize(
    ("signum", "nproc"),
    [
        (signal.SIGTERM, 1),
        pytest.param(signal.SIGTERM, 2, marks=pytest.mark.slow),  # (ctrl-c-2: the launcher's)
        pytest.param(signal.SIGINT, 1, marks=pytest.mark.slow),  # (sigterm-1: one rank's)
        (signal.SIGINT, 2),
    ],
    ids=["sigterm-1", "sigterm-2", "ctrl-c-1", "ctrl-c-2"],
)
def test_a_signal_saves_a_checkpoint_before_the_ranks_exit(tmp_path, signum, nproc):
    """One rank runs in the command's process; two run under torch's launcher, which passes
    the signal on to them. SIGTERM goes to the command (as a scheduler sends it), SIGINT to
    every process of its session (as a terminal sends Ctrl-C: the ranks get it twice, from the
    terminal and from the launcher, and stop once). The run finishes its step, saves, says so
    in one line and exits 128 + the signal, with no traceback."""
    saves = tmp_path / "ckpt"
    command = [
        sys.executable, "-u", "-m", "zerocc", "train", str(PLAN), "--nproc", str(nproc),
        "--steps", "100000", "--save", str(saves),
    ]  # fmt: skip
    env = {**CPU_ONLY, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # the explanation is printed once the first step has run
        lines.append(line)
        if "model states per rank" in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signum, out[-3000:]
    stopped = re.search(rf"stopped by {signum.name} after micro-batch (\d+): (\S+);", out)
    assert stopped, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    latest = (saves / "latest").read_text().strip()
    assert saves / latest == Path(stopped.group(2))
    manifest = json.loads((saves / latest / "manifest.json").read_text())
    assert manifest["meta"]["step"] == int(stopped.group(1))
    assert manifest["meta"]["world_size"] == nproc


def test_a_second_ctrl_c_stops_a_rank_at_once(monkeypatch):
    """The first SIGINT asks for a stop after the step; one within a second of it is the same
    Ctrl-C (the launcher passing it on); a later one exits at once, 130."""
    from zerocc.cli.train import _StopRequest

    now = [0.0]
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN in a job a shell started in background)
    stop = _StopRequest(save_on_sigterm=False, clock=lambda: now[0])
    try:
        assert signal.getsignal(signal.SIGTERM) is not stop._handle  # (no folder: default)
        stop._handle(signal.SIGINT, None)
        now[0] = 0.5
        stop._handle(signal.SIGINT, None)
        assert stop.signal == signal.SIGINT and exits == []
        now[0] = 2.0
        stop._handle(signal.SIGINT, None)
        assert exits == [128 + signal.SIGINT]
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


# (from disk: the same restart as from memory, and the same load as a resumed run: slow)
@pytest.mark.parametrize(
    "in_memory", [pytest.param(False, marks=pytest.mark.slow), True], ids=["from-disk", "in-memory"]
)
def test_a_rank_killed_mid_run_restarts_every_rank_from_the_last_checkpoint(tmp_path, in_memory):
    """`--max-restarts 1`: rank 1 is killed by SIGKILL reading its 6th batch (after step 5,
    saved every 2 steps); every rank starts again from step 4 on disk (with
    `checkpoint.in_memory`, from step 5 in memory: no step lost) and trains to step 8. The final
    checkpoint is the uninterrupted run's, every tensor bit for bit (weights, AdamW states, RNG
    states), and so is the final loss."""
    import yaml

    plan = yaml.safe_load(PLAN.read_text())
    plan["workload"] = f"{Path(__file__).parent / 'dying_workload.py'}:workload"
    plan["workload_args"]["kill_at"] = 5
    dying = tmp_path / "dying.yaml"
    dying.write_text(yaml.safe_dump(plan))
    restarted, straight = tmp_path / "restarted", tmp_path / "straight"
    command = [sys.executable, "-m", "zerocc", "train", str(dying), "--nproc", "2",
               "--steps", "8", "--save-every", "2", "--max-restarts", "1"]  # fmt: skip
    memory = ["--set", "checkpoint.in_memory=true"] if in_memory else []
    run = subprocess.run([*command, "--save", str(restarted), *memory], capture_output=True,
                         text=True, timeout=600, env=CPU_ONLY)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "zerocc: restart 1: every rank starts again from" in out
    if in_memory:
        start = re.search(r"starts again from step 5 in memory \((/dev/shm/zerocc-run-\w+)\)", out)
        assert start and "resumed from memory at micro-batch 5" in out, out[-3000:]
        assert not Path(start.group(1)).exists()  # (the launcher removed it at the end)
        assert "checkpoints in memory: every step" in out
    else:
        assert f"{restarted / 'step-00000004'}" in out and "at micro-batch 4" in out
    plan["workload_args"]["kill_at"] = 10**6  # never
    dying.write_text(yaml.safe_dump(plan))
    whole = subprocess.run([*command, "--save", str(straight)], capture_output=True, text=True,
                           timeout=600, env=CPU_ONLY)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "zerocc: restart" not in whole.stdout
    last = "step-00000008"
    assert checkpoint_digests(restarted / last) == checkpoint_digests(straight / last)
    assert final_loss(out) == final_loss(whole.stdout)


# (from disk: the restart of the from-disk case above and a resharded load, both tested: slow)
@pytest.mark.parametrize(
    "in_memory", [pytest.param(False, marks=pytest.mark.slow), True], ids=["from-disk", "in-memory"]
)
def test_a_rank_that_cannot_come_back_leaves_the_run_to_fewer_ranks(tmp_path, in_memory):
    """Rank 1 dies at step 6 on every attempt; after its restart fails too, `--nproc-min 1`
    goes on with one rank from the checkpoint of step 4 (resharded on load) to step 8. With
    `checkpoint.in_memory` the ranks' snapshots of step 5, of 2 ranks, outlive the launch:
    the rank of the smaller run writes them out as a checkpoint and goes on from step 5."""
    import yaml

    plan = yaml.safe_load(PLAN.read_text())
    plan["workload"] = f"{Path(__file__).parent / 'dying_workload.py'}:workload"
    plan["workload_args"] |= {"kill_at": 5, "every_attempt": True}
    dying = tmp_path / "dying.yaml"
    dying.write_text(yaml.safe_dump(plan))
    saves = tmp_path / "ckpt"
    command = [sys.executable, "-m", "zerocc", "train", str(dying), "--nproc", "2",
               "--steps", "8", "--save-every", "2", "--max-restarts", "1", "--nproc-min", "1",
               "--save", str(saves)]  # fmt: skip
    command += ["--set", "checkpoint.in_memory=true"] if in_memory else []
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "going on with 1 rank(s), not 2 (--nproc-min 1)" in out
    if in_memory:
        assert ("zerocc: the snapshots of step 5 in memory are of 2 ranks, not 1: written out to "
                f"{saves / 'step-00000005'} to load resharded") in out, out[-3000:]  # fmt: skip
        assert "at micro-batch 5" in out and "3 step(s) on 1 rank(s)" in out
    else:
        assert "at micro-batch 4" in out and "4 step(s) on 1 rank(s)" in out
    manifest = json.loads((saves / "step-00000008" / "manifest.json").read_text())
    assert manifest["meta"]["world_size"] == 1


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--set", "checkpoint.in_memory=true"], "it goes with --max-restarts"),
        (["--max-restarts", "1"], "--max-restarts 1 needs a checkpoint folder"),
        (["--max-restarts", "1", "--save", "ckpt", "--nproc-min", "3"], "--nproc-min 3: from 1"),
        (["--save", "ckpt", "--nproc-min", "1"], "--nproc-min goes with --max-restarts"),
    ],
    ids=["in-memory", "no-folder", "nproc-min-range", "nproc-min-alone"],
)
def test_restart_flags_that_cannot_work_are_refused_before_any_rank_starts(flags, error, capsys):
    from zerocc.cli.main import main

    assert main(["train", str(PLAN), "--steps", "1", "--nproc", "2", *flags]) == 2
    assert error in capsys.readouterr().err


def test_snapshots_that_would_not_fit_in_shared_memory_are_refused_before_launch(
    monkeypatch, capsys, tmp_path
):
    """`checkpoint.in_memory` keeps each rank's state twice in /dev/shm, a tmpfs that kills
    the writer by SIGBUS once full: `zerocc train` refuses before it launches any rank where
    the machine's ranks' snapshots would not fit (host memory is checked at the first save,
    once the ranks hold their states)."""
    import shutil
    from collections import namedtuple

    from zerocc.cli import main as cli
    from zerocc.cli import train_command

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks launched")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(train_command, "launch_ranks", no_launch)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 0, 10**6))
    flags = ["--max-restarts", "1", "--save", str(tmp_path), "--set", "checkpoint.in_memory=true"]
    assert cli.main(["train", str(PLAN), "--steps", "1", "--nproc", "2", *flags]) == 2
    said = capsys.readouterr().err
    assert "checkpoint.in_memory: the snapshots " in said and "'s 2 rank(s) keep (" in said
    assert "do not fit in its memory (976.6KiB free in /dev/shm)" in said, said
