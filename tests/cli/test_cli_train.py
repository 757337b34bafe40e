"""`zerocc train` end to end: local gloo ranks through torch.distributed.run, with a summary.
(On GPUs: tests/test_cuda.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from train_runs import CPU_ONLY

from zerocc.inspect.plan_refine import REFINED
from zerocc.runtime.launch import Launched

PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3.yaml"


def test_train_launches_two_ranks_and_summarizes(tmp_path):
    """... with a plan field set on the command line, which the launched ranks read too; and
    leaves nothing of its own in the temporary folder (torchrun's agent made a
    `torchelastic_*` folder there per launch unless given one)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "zerocc", "train", str(PLAN), "--nproc", "2", "--steps", "3",
         "--set", "grad_accumulation=2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**CPU_ONLY, "TMPDIR": str(temporary)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # (Inductor's cache folder, kept across runs by design, is all that may stay)
    left = [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []
    out = run.stdout + run.stderr
    assert "world size 2" in out and "all_gather" in out and "reduce_scatter" in out
    assert "grad_accumulation 2" in out  # the explain of rank 0, a launched rank
    assert "3 step(s) (6 micro-batches) on 2 rank(s)" in out
    assert "model state per rank" in out and "(mean over 2 rank(s), up to step 3)" in out


def test_train_checks_the_model_before_launching_any_rank(monkeypatch, capsys):
    """`units.classes: [Blok]` was found by every launched rank, after they started (issue 50):
    the launcher builds the model once and finds it before launching any."""
    from zerocc.cli import main as cli
    from zerocc.cli import train_command

    launches = []
    monkeypatch.setattr(
        train_command, "launch_ranks", lambda *args: launches.append(args) or Launched(0)
    )
    bad = ["train", str(PLAN), "--nproc", "2", "--set", "units.classes=[Blok]"]
    assert cli.main(bad) == 2
    err = capsys.readouterr().err
    assert "units.classes: no module of class 'Blok' in the model" in err
    assert launches == []
    assert cli.main(["train", str(PLAN), "--nproc", "2"]) == 0
    assert len(launches) == 1


def test_train_checks_the_model_states_fit_before_launching_any_rank(monkeypatch, capsys):
    """Issue 50: a plan whose model states the machine cannot hold was found by every rank
    after it started; the launcher finds it first, with the ranks' own message (the states of
    both local ranks against this machine's memory, and the plan changes that would fit)."""
    from zerocc.cli import main as cli
    from zerocc.cli import train_command
    from zerocc.runtime import machine_memory

    launches = []
    monkeypatch.setattr(
        train_command, "launch_ranks", lambda *args: launches.append(args) or Launched(0)
    )
    monkeypatch.setattr(machine_memory, "available_memory", lambda device: {"host": 2**20})
    assert cli.main(["train", str(PLAN), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "the model states of this plan do not fit in memory (rank 0" in err
    assert "× 2 ranks" in err and "available: 1.0MiB" in err
    assert launches == []
    unchecked = ["train", str(PLAN), "--nproc", "2", "--set", "backend.check_memory=false"]
    assert cli.main(unchecked) == 0
    assert len(launches) == 1


def test_fewer_ranks_go_on_only_where_a_rank_was_lost(monkeypatch, tmp_path):
    """`--nproc-min`: after a lost rank (killed: no error of its own) the run goes on with
    fewer; after ranks that all raised an error (a plan, a batch) it does not start them again
    to meet the same error."""
    from zerocc.cli import main as cli
    from zerocc.cli import train_command
    from zerocc.runtime.launch import lost_a_rank

    killed = {0: (1, 11), 1: (-9, 12)}
    assert lost_a_rank(killed, {0: {"error": "RankStoppedError: rank 1 is gone"}})
    assert not lost_a_rank(killed, {0: {"error": "PlanError"}, 1: {"error": "PlanError"}})
    command = ["train", str(PLAN), "--nproc", "2", "--save", str(tmp_path), "--max-restarts",
               "1", "--nproc-min", "1"]  # fmt: skip
    for outcomes, launched in (
        ([Launched(2, lost_a_rank=False)], [2]),
        ([Launched(2, lost_a_rank=True), Launched(0)], [2, 1]),
    ):
        ends, nprocs = iter(outcomes), []

        def fake_launch(plan, args, *rest, ends=ends, nprocs=nprocs):
            nprocs.append(args.nproc)
            return next(ends)

        monkeypatch.setattr(train_command, "launch_ranks", fake_launch)
        assert cli.main(command) == outcomes[-1].status
        assert nprocs == launched


def test_train_auto_searches_first_and_gives_the_ranks_its_choice(monkeypatch, capsys, tmp_path):
    """`zerocc train PLAN --auto` (issue 52): the plan search's table, then the ranks launched
    with the choice as `--set` items (the fields the plan leaves open: here the stage and
    recomputation), the stage the plan fixes kept."""
    from zerocc.cli import main as cli
    from zerocc.cli import train_command

    plan = tmp_path / "plan.yaml"
    data = yaml.safe_load(PLAN.read_text())
    data["workload"] = f"{PLAN.parent / 'workload.py'}:workload"
    del data["zero"]
    plan.write_text(yaml.safe_dump(data))
    launches = []

    def launch(plan, args, command, *rest):
        launches.append(command)
        return Launched(0)

    monkeypatch.setattr(train_command, "launch_ranks", launch)
    assert cli.main(["train", str(plan), "--nproc", "2", "--auto"]) == 0
    out = capsys.readouterr().out
    # (stages 0-3 × recompute none, half, all; the pick with units of two blocks, in buckets,
    # and the faster of those, units of two blocks, in buckets of two such units)
    assert "15 candidate plans on 2 ranks" in out
    (command,) = launches
    sets = dict(command[i + 1].split("=", 1) for i, flag in enumerate(command) if flag == "--set")
    # (and the knobs tried around the pick, where it is one of those)
    assert {"zero.stage", "recompute.units"} <= set(sets) <= {"zero.stage", "recompute.units",
                                                              *REFINED}  # fmt: skip
    stage, recompute = (yaml.safe_load(sets[k]) for k in ("zero.stage", "recompute.units"))
    assert f"best: zero.stage: {stage}, recompute.units: {recompute}" in out
    assert "--auto" not in command
    assert cli.main(["train", str(plan), "--nproc", "2", "--memory", "1"]) == 2
    assert "--memory goes with --auto" in capsys.readouterr().err


def test_train_in_process_leaves_no_dump_folder_behind(tmp_path, monkeypatch):
    """`--dump` is set for the command only: a later step of the same process (a script that
    calls the CLI, then compiles) does not dump."""
    from zerocc.cli.main import main
    from zerocc.inspect.dumps import DUMP_DIR_ENV

    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    dump = tmp_path / "dump"
    assert main(["train", str(PLAN), "--nproc", "1", "--steps", "1", "--dump", str(dump)]) == 0
    assert dump.is_dir()
    assert DUMP_DIR_ENV not in os.environ


def test_steps_are_optimizer_steps_under_accumulation(tmp_path):
    """`--steps 3` with `grad_accumulation: 2`: three optimizer steps, six micro-batches."""
    folder = tmp_path / "gpt"
    shutil.copytree(PLAN.parent, folder)
    plan = yaml.safe_load(PLAN.read_text()) | {"grad_accumulation": 2}
    (folder / "accum.yaml").write_text(yaml.safe_dump(plan))
    command = [sys.executable, "-m", "zerocc", "train", str(folder / "accum.yaml"), "--nproc", "1"]
    run = subprocess.run([*command, "--steps", "3"], capture_output=True, text=True, timeout=600,
                         env=CPU_ONLY)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "3 step(s) (6 micro-batches) on 1 rank(s)" in out
    assert "up to step 3)" in out


def test_a_rank_ends_as_at_a_normal_exit_but_without_finalizing(tmp_path):
    """A launched rank ends by os._exit (see `zerocc.cli.main._end_rank`): its non-daemon
    threads are joined and its exit functions run first, as the interpreter would, and the
    status is the command's. A thread pool left open (Inductor's compile threads, after a
    compile) is shut down first, as at a normal exit: joined before, its idle workers waited
    for work forever, and `zerocc train --backend inductor` never ended after a cold compile."""
    script = f"""
import atexit, concurrent.futures, pathlib, threading, time
from zerocc.cli.main import _end_rank
out = pathlib.Path({str(tmp_path)!r})
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.2)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(time.sleep, 0.1).result()
_end_rank(3)
(out / "after").write_text("not reached")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 3, run.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert not (tmp_path / "after").exists()


def test_a_rank_whose_exit_waits_on_a_thread_names_it(tmp_path):
    """A thread of the workload's that outlives the rank's work keeps the exit waiting (its
    work is not cut off), and the rank says which after `EXIT_NOTICE_S`."""
    script = f"""
import pathlib, threading, time
import zerocc.cli.main as main
main.EXIT_NOTICE_S = 0.2
def upload():
    time.sleep(1.0)
    (pathlib.Path({str(tmp_path)!r}) / "uploaded").write_text("done")
threading.Thread(target=upload, name="uploader").start()
main._end_rank(0)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "RANK": "1"})  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "uploaded").read_text() == "done"
    assert "zerocc: rank 1 is done and has waited 0.2 s for its threads to end: uploader" in (
        run.stderr
    )


def test_the_pipeline_summary_names_the_step_its_waiting_share_is_of(capsys):
    """A resumed pipeline run's summary: the waiting share is of the last step, said by its
    number (step 8, counted on from the checkpoint), not of the run."""
    from zerocc.cli.train import _print_summary

    summary = {"pipeline_waiting_share": 0.207, "predicted_peak_bytes": 2**20}
    _print_summary(summary, 4, 1, None, 0.0, 1.0, 4, last_step=8)
    out = capsys.readouterr().out
    assert "pipeline: rank 0 waited 20.7% of the last step (step 8) for a neighbour" in out
