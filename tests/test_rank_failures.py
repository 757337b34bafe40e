"""A rank that stops, runs out of data or dies: every other rank stops too, with an error that
names it, and `zerocc train` says what became of each rank (zerocc/engine/watchdog.py,
zerocc/runtime/launch.py, the TrainStep's agreement on each micro-batch).

The multi-rank cases run `zerocc train` on 2 local CPU ranks with a tiny workload whose batches
misbehave on purpose (WORKLOAD below).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zerocc.runtime.launch import _stopped_by, error_once, failure_report

WORKLOAD = """
import os, signal, time
import torch
from torch import nn
from zerocc.compiler.workload import Workload


def workload(stop_rank=-1, stop_at=3, batches=100, short_rank=-1, raise_rank=-1,
             between_rank=-1, between_at=3, between_signal="SIGSTOP", pace=0.0,
             first_attempt_only=False):
    torch.manual_seed(0)
    counted = [0]

    def tokens(batch):  # called after each micro-batch, between the step and the metrics
        counted[0] += 1
        if counted[0] == 1:
            with open(f"pid-{os.environ['RANK']}", "w") as f:
                f.write(str(os.getpid()))
        time.sleep(pace)
        again = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if int(os.environ["RANK"]) == between_rank and counted[0] == between_at and not (
            again and first_attempt_only
        ):
            time.sleep(1)  # (as loading a batch would: its heartbeat tells it is after step 3)
            with open(f"stopped-{between_rank}", "w") as f:
                f.write(str(time.time()))
            if between_signal == "raise":
                raise ValueError("the token counter broke")
            os.kill(os.getpid(), getattr(signal, between_signal))
        return batch[0].shape[0]

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def make(rank, world):
        for i in range(4 if rank == short_rank else batches):
            if rank == stop_rank and i == stop_at:
                with open(f"stopped-{rank}", "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)  # as a debugger, or a hung rank, would
            if raise_rank in (rank, "all") and i == stop_at:
                raise ValueError("the data loader broke")
            g = torch.Generator().manual_seed(rank * 1000 + i)
            yield torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    return Workload(model, loss_fn=lambda m, x, y: ((m(x) - y) ** 2).mean(), batches=make,
                    tokens_per_batch=tokens)
"""


# A pipeline of the workload's two layers on the 2 ranks (each a stage, the batch theirs both):
# the safeguards of a pipeline step are a TrainStep's.
PIPELINE = "parallel: {pp: 2}\npipeline: {microbatches: 2}\nunits: {classes: [Linear]}\n"


def _train(
    tmp_path: Path, timeout_s: float | None = 30, extra: str = "", dry: bool = False,
    flags: tuple[str, ...] = (), **workload_args,
) -> subprocess.CompletedProcess | None:
    """``timeout_s`` None: the plan's default (600 s); ``extra``: more plan lines; ``dry``:
    write the files only; ``flags``: more flags of `zerocc train`."""
    (tmp_path / "workload.py").write_text(WORKLOAD)
    args = ", ".join(f"{k}: {v}" for k, v in workload_args.items())
    timeout = f", timeout_s: {timeout_s}" if timeout_s is not None else ""
    (tmp_path / "plan.yaml").write_text(
        textwrap.dedent(f"""\
            workload: "workload:workload"
            workload_args: {{{args}}}
            zero: {{stage: 3}}
            backend: {{device: cpu{timeout}}}
            """)
        + extra
    )
    if dry:
        return None
    command = [sys.executable, "-m", "zerocc", "train", "plan.yaml", "--nproc", "2", "--steps", "8"]
    command += flags
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180)


def test_a_stopped_rank_stops_the_job_within_the_timeout(tmp_path):
    timeout_s = 5
    run = _train(tmp_path, timeout_s, stop_rank=1, stop_at=3)
    ended = time.time()
    stopped = float((tmp_path / "stopped-1").read_text())
    assert run.returncode == 2, run.stderr
    # The timeout, a survey of the heartbeats (2.5 beats), exiting: "a few seconds".
    assert ended - stopped < timeout_s + 8, run.stderr
    error = next(ln for ln in run.stderr.splitlines() if ln.startswith("zerocc: rank 0: error"))
    assert "step 4" in error and "rank 1 (pid" in error and "stopped answering" in error
    assert "agreement on the next batch" in error and "backend.timeout_s (5 s)" in error
    assert "rank 1 (pid" in run.stderr.split("rank(s) failed:")[1]
    assert "the launcher killed it" in run.stderr


def test_ranks_end_with_their_launcher(tmp_path):
    """`kill -9` of `zerocc train`: its ranks end with it (they trained on as orphans)."""

    def running(pid: int) -> bool:  # (not gone, not a zombie)
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    _train(tmp_path, batches=100000, pace=0.05, dry=True)
    command = [sys.executable, "-m", "zerocc", "train", "plan.yaml", "--nproc", "2",
               "--steps", "100000"]  # fmt: skip
    with (tmp_path / "output").open("w") as output:
        launcher = subprocess.Popen(command, cwd=tmp_path, stdout=output, stderr=output)
    pids = []
    try:
        deadline = time.monotonic() + 150
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in tmp_path.glob("pid-*") if p.read_text()]
        assert len(pids) == 2, (tmp_path / "output").read_text()
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(running(p) for p in pids):
            time.sleep(0.1)
        left = [p for p in pids if running(p)]
        assert not left, f"ranks {left} outlived their launcher by 10 s"
    finally:
        launcher.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_restart_names_the_lost_rank_and_the_summary_counts_restarts_and_steps_recomputed(
    tmp_path,
):
    """Rank 1 is killed (SIGKILL, from outside) after step 5 of the first attempt; saved every
    2 steps, every rank starts again from step 4: the restart's line says which rank was lost
    and how, and the summary says 1 restart and 1 step recomputed (step 5)."""
    flags = ("--max-restarts", "1", "--save", "ckpt", "--save-every", "2")
    run = _train(tmp_path, flags=flags, between_rank=1, between_at=5,
                 between_signal="SIGKILL", first_attempt_only=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    lost = re.search(r"zerocc: restart 1: the attempt before lost rank 1 \(pid \d+\): killed by "
                     r"SIGKILL: killed without an error of its own, not by this launcher's (.*)",
                     out)  # fmt: skip
    assert lost and "rank 0" not in lost.group(1), out  # (rank 0 only met rank 1's absence)
    assert "restarts: 1; 1 step(s) recomputed" in run.stdout, out


def _error_of(run: subprocess.CompletedProcess, rank: int) -> str:
    said = f"zerocc: rank {rank}: error"
    return next(ln for ln in run.stderr.splitlines() if ln.startswith(said))


@pytest.mark.parametrize("extra", ["", pytest.param(PIPELINE, marks=pytest.mark.slow)],
                         ids=["zero3", "pipeline"])  # fmt: skip
def test_a_rank_stopped_between_steps_is_named_within_a_minute_at_default_settings(
    tmp_path, extra
):
    """Rank 1 stops (SIGSTOP) after step 3, before the metrics' gather that rank 0 waits in,
    under the default backend.timeout_s (600 s): the heartbeats' watch names it (rank, pid,
    what it last did) after 30 silent seconds, the launcher kills it and says so; no raw
    process-group traceback, no 600 s wait and no 30 s of torchrun's grace."""
    run = _train(tmp_path, None, extra, between_rank=1, between_at=3)
    ended = time.time()
    stopped = float((tmp_path / "stopped-1").read_text())
    assert run.returncode == 2, run.stderr
    assert ended - stopped < 60, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    error = _error_of(run, 0)
    assert "rank 0, step 4: rank 1 (pid" in error and "stopped answering" in error, error
    assert "last seen after step 3" in error, error
    assert "gave up in the metrics' gather after step 3" in error, error
    assert "after rank 1's heartbeat stood still for 30 s" in error, error
    report = run.stderr.split("rank(s) failed:")[1]
    assert "rank 1 (pid" in report and "killed by SIGKILL: it stopped answering its peers (rank 0 "\
        "reported it silent), and the launcher killed it" in report, report


@pytest.mark.parametrize("extra", ["", PIPELINE], ids=["zero3", "pipeline"])
def test_a_rank_killed_between_steps_is_named_not_a_connection_reset(tmp_path, extra):
    """Rank 1 is SIGKILLed (not by the launcher) after step 3: rank 0, in the metrics' gather,
    names it, or the launcher stops it first and says after what; no raw gloo error either
    way, and the report does not claim the launcher killed rank 1."""
    run = _train(tmp_path, 30, extra, between_rank=1, between_at=3, between_signal="SIGKILL")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "Connection" not in run.stderr, run.stderr
    report = run.stderr.split("rank(s) failed:")[1]
    assert "rank 1 (pid" in report and "killed by SIGKILL" in report, report
    assert "not by this launcher's watch" in report, report
    assert "the launcher killed it" not in report, report
    if "zerocc: rank 0: error" in run.stderr:  # (rank 0 named it before torchrun's SIGTERM)
        error = _error_of(run, 0)
        assert "rank 1 (pid" in error and "gave up in the metrics' gather after step 3" in error
    else:
        assert "stopped by the launcher after rank 1 (killed by SIGKILL) ended" in report, report


def test_an_error_of_rank_0_alone_between_steps_is_said_once_not_as_a_peers_traceback(tmp_path):
    """Rank 0's workload raises between steps (its token count), rank 1 waits in the metrics'
    gather: the run says rank 0's error (the workload's, a PlanError), and rank 1 no raw
    process-group traceback: it names rank 0 as gone, or the launcher stops it first."""
    run = _train(tmp_path, between_rank=0, between_at=3, between_signal='"raise"')
    assert run.returncode == 2, run.stderr
    assert "Traceback (most recent call last)" not in run.stderr, run.stderr
    assert "Connection" not in run.stderr, run.stderr
    error = _error_of(run, 0)
    assert "tokens_per_batch(batch) raised ValueError: the token counter broke" in error, error
    rank_1 = run.stderr.split("rank(s) failed:")[1].split("rank 1 (pid")[1]
    assert "killed by SIGTERM: stopped by the launcher after rank 0 failed" in rank_1 or (
        "last error: RankStoppedError: rank 1, step 4: rank 0 (pid" in rank_1
        and "exited" in rank_1
    ), rank_1


def test_a_rank_out_of_data_stops_every_rank(tmp_path):
    run = _train(tmp_path, short_rank=1)
    assert run.returncode == 2, run.stderr
    # Both ranks meet the error, each saying where: the launcher prints the first rank's
    # whole, the other's in its line of the report (not a line of each rank's own besides).
    (line,) = [ln for ln in run.stderr.splitlines() if "error: rank 0, step 5" in ln]
    assert line.startswith("zerocc: rank 0: error: ")
    assert "rank(s) 1 ran out of batches while rank(s) 0 still had one" in line
    report = run.stderr.split("rank(s) failed:")[1]
    assert "last error: the error above (DataExhaustedError)" in report, run.stderr
    assert "last error: DataExhaustedError: rank 1, step 5: rank(s) 1 ran out" in report
    assert run.stderr.count("ran out of batches") == 2


def test_every_rank_out_of_data_at_once_ends_training(tmp_path):
    run = _train(tmp_path, batches=4)
    assert run.returncode == 0, run.stderr
    assert "the data ran out on every rank after 4 step(s)" in run.stdout


def test_a_rank_that_dies_is_named_with_its_error(tmp_path):
    """... its workload's data loader raised: said as the workload's error, with the frames of
    the workload's code only."""
    run = _train(tmp_path, raise_rank=1, stop_at=2)
    assert run.returncode == 2, run.stderr
    report = run.stderr.split("rank(s) failed:")[1]
    assert "rank 1 (pid" in report and "exit code 2" in report
    assert "last error: the error above (PlanError)" in report
    assert "rank 0 (pid" in report and "stopped by the launcher after rank 1 failed" in report
    said = run.stderr.split("zerocc: rank 1: error: ")[1].split("\nzerocc: ")[0]
    assert said.startswith(
        "workload: workload:workload: batches(1, 2) raised ValueError: the data loader broke\n"
        "Traceback of the workload's code (most recent call last):\n"
    )
    assert said.endswith('in make\n    raise ValueError("the data loader broke")'), said


def test_a_workload_that_raises_on_every_rank_shows_its_traceback_once(tmp_path):
    """The user's code raised on both ranks: its traceback once (the first rank's, printed by
    the launcher), then a line per rank."""
    run = _train(tmp_path, raise_rank='"all"', stop_at=2)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("Traceback of the workload's code") == 1, run.stderr
    assert 'raise ValueError("the data loader broke")' in run.stderr
    report = run.stderr.split("rank(s) failed:")[1]
    # (the other rank's error differs by its rank: `batches(r, 2)`, said in a line)
    assert report.count("last error: the error above (PlanError)") == 1
    assert re.search(r"last error: PlanError: workload: workload:workload: batches\([01], 2\) "
                     r"raised ValueError: the data loader broke\n", report), report


@pytest.mark.slow
def test_a_pipelines_data_loader_that_raises_is_said_once_for_its_ranks(tmp_path):
    """A pipeline's 2 ranks read one data rank's batches: its loader raised on both, said once
    with the workload's traceback, each rank's line pointing to it (as any run's ranks)."""
    run = _train(tmp_path, 30, PIPELINE, raise_rank='"all"', stop_at=2)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("Traceback of the workload's code") == 1, run.stderr
    assert "batches(0, 1) raised ValueError: the data loader broke" in run.stderr, run.stderr
    report = run.stderr.split("rank(s) failed:")[1]
    assert report.count("last error: the error above (PlanError)") == 2, report


def _leave_early(rank: int, world: int, pp: int = 1) -> str:
    import torch

    import zerocc

    model = torch.nn.Linear(4, 1)
    plan = {"zero": {"stage": 3}, "backend": {"device": "cpu", "timeout_s": 60}}
    if pp > 1:  # (a pipeline of two layers, a stage each)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        plan |= {"parallel": {"pp": pp}, "pipeline": {"microbatches": 2},
                 "units": {"classes": ["Linear"]}}  # fmt: skip
    step = zerocc.compile(model, plan, loss_fn=lambda m, x: m(x).pow(2).mean())
    for _ in range(2):
        step(torch.ones(2, 4))
    if rank == 1:  # a script that stops training early, and exits (spawned ranks skip atexit)
        step.comm.close()  # what zerocc does at interpreter exit
        return "left"
    started = time.monotonic()
    try:
        step(torch.ones(2, 4))
    except zerocc.RankStoppedError as exc:
        return f"{time.monotonic() - started:.1f} s: {exc}"
    return "no error"


@pytest.mark.parametrize("pp", [1, 2], ids=["zero3", "pipeline"])
def test_a_rank_that_left_is_named_at_once_not_after_the_timeout(pp):
    from multirank import run_ranks

    waited, message = run_ranks(2, _leave_early, pp)[0].split(" s: ", 1)
    assert float(waited) < 20, message  # the timeout is 60 s
    assert "rank 1 (pid" in message and "exited (after step 2)" in message


def _slow_compile(
    rank: int, world: int, timeout_s: float, backend: str
) -> tuple[list[float], list[str]]:
    import torch
    import torch._inductor.compile_fx as inductor

    import zerocc

    def loss_fn(model, x):  # runs when the step is traced: rank 1 traces slowly
        if rank == 1 and backend == "eager":
            time.sleep(2 * timeout_s)
        return model(x).pow(2).mean()

    def compile_fx(*args, **kwargs):  # rank 1's Inductor compiles slowly (a cold cache)
        if rank == 1:
            time.sleep(2 * timeout_s)
        return compile_slowly(*args, **kwargs)

    compile_slowly, inductor.compile_fx = inductor.compile_fx, compile_fx
    torch.manual_seed(0)
    plan = {
        "zero": {"stage": 3},
        "backend": {"name": backend, "device": "cpu", "timeout_s": timeout_s},
    }
    step = zerocc.compile(torch.nn.Linear(4, 1), plan, loss_fn=loss_fn)
    losses = [float(step(torch.ones(2, 4))) for _ in range(2)]
    # a comm given (calibration's wrapper; here the step's own) makes profiling lower it again
    losses.append(float(step.profile(torch.ones(2, 4), comm=step.comm)[0]))
    return losses, step.record().backend_notes


# (Inductor's lowering waited for as the eager one is: the same agreement, a longer compile)
@pytest.mark.parametrize(
    "backend",
    ["eager", *(pytest.param(b, marks=pytest.mark.slow) for b in ("inductor-whole", "inductor"))],
)
def test_compiling_does_not_count_against_the_timeout(backend):
    """Rank 1 traces, or Inductor compiles, for twice ``backend.timeout_s``: rank 0 waits for
    it (before the program's agreement, or after its lowering, also when a step profiled on
    another comm lowers it again), and both train."""
    from multirank import run_ranks

    (losses, notes), (theirs, _) = run_ranks(2, _slow_compile, 2.0, backend)
    assert losses == theirs and len(losses) == 3
    assert backend == "eager" or "compiled" in notes[0], notes


def _whole_on_rank_0_only(rank: int, world: int) -> tuple[list[float], list[str], list[str]]:
    import warnings

    import torch

    import zerocc
    from zerocc.backends.inductor import executable

    def rejected(*args, **kwargs):  # as if rank 1's host had no C++ compiler
        raise RuntimeError("no C++ compiler on this host")

    if rank == 1:
        executable.compile_whole = rejected
    torch.manual_seed(0)
    plan = {"zero": {"stage": 3}, "backend": {"name": "inductor-whole", "device": "cpu"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = zerocc.compile(torch.nn.Linear(4, 1), plan, loss_fn=lambda m, x: m(x).pow(2).mean())
        losses = [float(step(torch.ones(2, 4))) for _ in range(2)]
    said = [str(w.message) for w in caught if issubclass(w.category, zerocc.LoweringWarning)]
    return losses, step.record().backend_notes, said


def test_ranks_that_lower_a_program_differently_say_so_and_train():
    """Rank 1's Inductor rejects the whole program (it compiles by region), rank 0's takes it:
    both train, and every rank warns and notes each rank's form, not only its own."""
    from multirank import run_ranks

    (losses, notes, said), (theirs, their_notes, their_said) = run_ranks(2, _whole_on_rank_0_only)
    assert len(losses) == len(theirs) == 2
    forms = "rank 0: inductor: whole; rank 1: inductor: by region"
    assert len(said) == len(their_said) == 1 and forms in said[0] and forms in their_said[0]
    assert said[0] in notes and their_said[0] in their_notes
    assert "no C++ compiler on this host" in " ".join(their_notes)  # rank 1 says why


# -- the launcher's report, on made-up failures --------------------------------------------------


def test_sigkill_without_an_error_says_what_the_launcher_knows():
    """SIGKILL does not say who sent it: the report names both senders and weighs them with
    the rank's predicted need against the machine's memory."""
    gib = 2**30
    reports = {1: {"predicted_peak_bytes": 3 * gib, "local_ranks": 2}}
    text = failure_report({1: (-signal.SIGKILL, 42)}, reports, {}, memory_total=4 * gib)
    assert "rank 1 (pid 42): killed by SIGKILL" in text
    assert "by the out-of-memory killer or by a person or a scheduler" in text
    assert "predicted peak 3.0GiB per rank" in text and "6.0GiB for the 2 ranks" in text
    assert "this machine has 4.0GiB): the prediction exceeds the machine" in text
    roomy = failure_report({1: (-signal.SIGKILL, 42)}, reports, {}, memory_total=64 * gib)
    assert "the prediction fits the machine, so a kill from outside is likelier" in roomy


def test_report_names_signals_causes_and_last_errors():
    reports = {0: {"error": "ValueError: boom"}, 2: {}}
    failures = {0: (1, 10), 1: (-signal.SIGTERM, 11), 2: (-signal.SIGABRT, 12)}
    text = failure_report(failures, reports, {})
    lines = text.splitlines()
    assert lines[0] == "zerocc: 3 rank(s) failed:"
    # rank 0's error is the one error_once prints above the report: named, not repeated
    assert "rank 0 (pid 10): exit code 1" in text
    assert "last error: the error above (ValueError)" in text
    assert error_once(failures, reports) == "zerocc: rank 0: error: ValueError: boom\n"
    assert "rank 1 (pid 11): killed by SIGTERM: stopped by the launcher after rank 0 failed" in text
    assert "rank 2 (pid 12): killed by SIGABRT: aborted in native code" in text


def test_an_error_every_rank_met_alike_is_printed_once_whole():
    message = "checkpoint load of ck failed (rank 1: CheckpointError: ...);\nnothing was loaded"
    said = {"error": f"CheckpointError: {message.splitlines()[0]}", "message": message}
    reports = {0: dict(said), 1: dict(said)}
    failures = {0: (2, 10), 1: (2, 11)}
    assert error_once(failures, reports) == f"zerocc: error: {message}\n"
    text = failure_report(failures, reports, {})
    assert text.count("last error: the error above (CheckpointError)") == 2


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGSEGV])
def test_report_of_a_rank_the_launcher_killed_says_so(code):
    text = failure_report({1: (code, 7)}, {}, {1: 7})
    assert "it stopped answering its peers, and the launcher killed it" in text


def test_ranks_that_stopped_on_a_signal_are_a_stop_not_a_failure():
    """Every rank exited 130 (Ctrl-C reached the ranks, not the launcher): the launcher says
    the run stopped; one rank's error, or another exit code, is a failure it reports."""
    stopped = {0: (128 + signal.SIGINT, 10), 1: (128 + signal.SIGINT, 11)}
    assert _stopped_by(stopped, {0: {}, 1: {}}) == signal.SIGINT
    assert _stopped_by(stopped, {0: {"error": "ValueError: boom"}}) is None
    assert _stopped_by({**stopped, 1: (1, 11)}, {}) is None
    assert _stopped_by({0: (-signal.SIGINT, 10)}, {}) is None


def _leave_before_a_save(rank: int, world: int) -> str:
    import tempfile

    import torch

    import zerocc

    model = torch.nn.Linear(4, 1)
    plan = {"zero": {"stage": 3}, "backend": {"device": "cpu", "timeout_s": 60}}
    step = zerocc.compile(model, plan, loss_fn=lambda m, x: m(x).pow(2).mean())
    step(torch.ones(2, 4))
    if rank == 1:  # gone as a rank killed mid-save is
        step.comm.close()
        return "left"
    started = time.monotonic()
    try:
        step.save(tempfile.mkdtemp())
    except zerocc.RankStoppedError as exc:
        return f"{time.monotonic() - started:.1f} s: {exc}"
    except Exception as exc:
        return f"{time.monotonic() - started:.1f} s: not named: {type(exc).__name__}: {exc}"
    return "0 s: no error"


def test_a_peer_gone_during_a_save_is_named_not_a_raw_process_group_error():
    from multirank import run_ranks

    waited, message = run_ranks(2, _leave_before_a_save)[0].split(" s: ", 1)
    assert message.startswith("rank 0:") and "rank 1 (pid" in message, message
    assert "gave up in the checkpoint's" in message, message
    assert float(waited) < 20, message


def _one_collective_too_many(rank: int, world: int) -> str:
    import torch

    import zerocc

    model = torch.nn.Linear(4, 1)
    plan = {"zero": {"stage": 3}, "backend": {"device": "cpu", "timeout_s": 10}}
    step = zerocc.compile(model, plan, loss_fn=lambda m, x: m(x).pow(2).mean())
    for _ in range(2):
        step(torch.ones(2, 4))
    try:
        if rank == 1:  # code only rank 1 runs: a collective its peer never issues
            step.comm.all_reduce(torch.ones(4)).wait()
        step(torch.ones(2, 4))
    except zerocc.RankStoppedError as exc:
        return str(exc)
    except RuntimeError as exc:  # (the extra collective's own failure, on rank 1)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_ranks_on_different_collectives_are_told_where_their_collectives_part():
    """Rank 1 issues one all-reduce rank 0 never does, then both run a step: rank 0's error
    names the collective number where the two ranks' logs part and what each issued there
    (the flight recorder's idea: each rank's last collectives ride on its heartbeat)."""
    from multirank import run_ranks

    error = run_ranks(2, _one_collective_too_many, timeout=120)[0]
    assert "the ranks' collectives part at number" in error, error
    assert "rank 0: agreement, rank 1: all_reduce of 32B" in error, error  # (counted twice)


def test_collective_logs_name_the_first_difference_or_the_ranks_behind():
    from zerocc.engine.watchdog import PeerState, describe_divergence

    def rank(r: int, *log: tuple) -> PeerState:
        return PeerState(r, True, 100 + r, "host", "", False, log)

    gather, agree = ("all_gather", 6 * 2**20), ("agreement", 0)
    parted = describe_divergence(
        [rank(0, (5, *agree), (6, *gather)), rank(1, (5, *agree), (6, "all_reduce", 12))]
    )
    assert parted == (
        "the ranks' collectives part at number 6 (rank 0: all_gather of 6.0MiB, rank 1: "
        "all_reduce of 12B)"
    )
    behind = describe_divergence(
        [
            rank(0, (6, *gather), (7, *gather)),
            rank(1, (6, *gather)),
            rank(2, (6, *gather), (7, *gather)),
        ]
    )
    assert behind.startswith("the others issued collective number 7 (all_gather of 6.0MiB)")
    assert "rank 1 at 6 (all_gather of 6.0MiB): behind" in behind
    assert describe_divergence([rank(0, (7, *gather)), rank(1, (7, *gather))]) == ""
    assert describe_divergence([rank(0, (7, *gather)), rank(1)]) == ""  # (no log to compare)

