"""One rank of `zerocc train`: compile the plan's workload, resume from a checkpoint where the
plan says so, train, save checkpoints (every N steps, at the end, and when Ctrl-C or SIGTERM asks
the run to stop, as schedulers do before preemption), and print the summary on rank 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerocc.cli.metrics import Metrics, progress_text
from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import workload_code
from zerocc.errors import CheckpointError, ZeroccError
from zerocc.ir.quantities import human_bytes
from zerocc.local_ranks import ranks_on_this_machine
from zerocc.runtime.checkpoint.background import PendingSave, background_fits
from zerocc.runtime.checkpoint.files import PREFIX, resolve, saved_checkpoints
from zerocc.runtime.checkpoint.in_memory import MemoryCheckpoints
from zerocc.runtime.failures import gathered
from zerocc.runtime.launch import in_memory_folder, report, started_before
from zerocc.runtime.restarts import StepProgress, lost_before, note_resumed, restart_summary


def train_rank(plan: Plan, steps: int) -> int:
    """One rank: join the process group (when launched), compile the workload, run `steps`.
    What the launcher should know (the predicted peak, the error that ends the rank and the
    peers it found silent) goes to the rank's report (`zerocc.runtime.launch.report`)."""
    from zerocc.runtime.rank import joined_group

    # The step's groups close before the default group goes, on an error too (the error's
    # traceback would keep them alive into the interpreter's exit, where gloo's threads can
    # abort the process: a failed rank then dies of SIGABRT, not of its error).
    with joined_group(plan) as (rank, world_size), contextlib.ExitStack() as closing:
        try:
            return _train_steps(plan, steps, rank, world_size, closing)
        except KeyboardInterrupt:  # Ctrl-C before the run's own handler (compiling, loading)
            if rank == 0:
                print("zerocc: interrupted before training began", file=sys.stderr)
            return 128 + signal.SIGINT
        except BaseException as exc:
            silent = [vars(p) for p in getattr(exc, "silent", [])]
            report(error=f"{type(exc).__name__}: {exc}".splitlines()[0], silent=silent)
            raise


class _StopRequest:
    """A signal asking the run to stop after its step: SIGINT (Ctrl-C) always, SIGTERM when a
    checkpoint folder is set (as schedulers send before preemption; without one SIGTERM ends
    the rank as it would any process). The run finishes its step, saves where a folder is set,
    says so in one line and exits ``128 + signal``. Every rank must stop after the same step,
    so the ranks agree at each step's end (one small gather over the control group): a rank
    signalled a moment later than another still stops with it.

    A second SIGINT stops the rank at once (exit 130, no traceback; a checkpoint being written
    is left uncommitted, the last committed one stays). One that comes within ``REPEAT_S`` of
    the first is the same Ctrl-C: a terminal signals every process of the run, and the launcher
    passes its own signal on to the ranks."""

    REPEAT_S = 1.0

    def __init__(self, save_on_sigterm: bool, clock=time.monotonic) -> None:
        self.signal: signal.Signals | None = None  # the first that asked, on this rank
        self._clock, self._interrupted_at = clock, None
        handled = [signal.SIGINT] + [signal.SIGTERM] * save_on_sigterm
        self._previous = {s: signal.signal(s, self._handle) for s in handled}

    def _handle(self, signum: int, frame: Any) -> None:
        now = self._clock()
        if signum == signal.SIGINT and self._interrupted_at is not None:
            if now - self._interrupted_at > self.REPEAT_S:
                print("zerocc: interrupted again: stopping now", file=sys.stderr, flush=True)
                os._exit(128 + signal.SIGINT)
            return
        if signum == signal.SIGINT:
            self._interrupted_at = now
        self.signal = self.signal or signal.Signals(signum)

    def agreed(self, step) -> signal.Signals | None:
        """The signal any rank was asked to stop by (a collective: every rank calls it at
        each step's end), None while none was. A peer gone or silent meanwhile is named as in
        a step (RankStoppedError)."""
        where = f"the ranks' agreement to stop or go on after step {step.steps}"
        told = gathered(step.comm, self.signal, where, getattr(step, "health", None))
        asked = [s for s in told if s is not None]
        return asked[0] if asked else None

    def restore(self) -> None:
        """The handlers as they were before the run."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _train_steps(
    plan: Plan, steps: int, rank: int, world_size: int, closing: contextlib.ExitStack
) -> int:
    """Compile the workload, resume where the plan says, train up to ``steps`` optimizer
    steps (fewer when the data runs out or SIGTERM stops the run) and report on rank 0."""
    import zerocc
    from zerocc.compiler.workload import load_workload

    workload = load_workload(plan)
    step = zerocc.compile(workload.model, plan, loss_fn=workload.loss_fn)
    closing.callback(step.comm.close)
    memory = _memory_checkpoints(step, plan)
    restart = _restarted(step)
    if restart and rank == 0:
        print(f"zerocc: restart {restart}: the attempt before lost "
              f"{lost_before(restart) or 'a rank (on another machine, or how is not known)'}",
              flush=True)  # fmt: skip
    if not (memory is not None and _restored_from_memory(step, plan, memory, restart)):
        resume = _resume_point(plan, rank, restart)
        if resume is not None:
            _resume(step, resume, rank)
    accum = plan.grad_accumulation
    if rank == 0:
        note_resumed(restart, step.micro_batches // accum)
    done = step.micro_batches  # micro-batches before this run (those of a resumed checkpoint)
    wanted = steps * accum  # --steps counts optimizer steps, each of `accum` micro-batches
    if done >= wanted:
        if rank == 0:
            print(f"the checkpoint is at optimizer step {done // accum}, --steps is {steps}: "
                  "nothing to train")  # fmt: skip
        return 0
    run = _Run(step, plan, workload, rank, memory)
    run.restart = restart
    closing.callback(run.progress.close)
    closing.callback(run.stop.restore)
    closing.callback(run.saver.settle)  # (before the comm closes)
    run.first_micro_batch()
    run.train(steps, wanted - done)
    if rank == 0:
        run.report(world_size)
    return 128 + run.stopped if run.stopped else 0


class _Run:
    """One rank's training run from its first micro-batch on: the batches (by data-parallel
    rank: the ranks of a tensor-parallel group train on one batch), the metrics, the saves."""

    def __init__(
        self, step, plan: Plan, workload, rank: int, memory: MemoryCheckpoints | None
    ) -> None:
        self.step, self.plan, self.rank = step, plan, rank
        self.accum = plan.grad_accumulation
        data_rank, data_ranks = step.data_rank, step.data_parallel
        self.where = f"{plan.workload}: batches({data_rank}, {data_ranks})"
        self.done = step.micro_batches  # before this run (those of a resumed checkpoint)
        self.batches = _batches_from(
            workload.batches(data_rank, data_ranks), self.done, data_rank, data_ranks
        )
        self.stop = _StopRequest(save_on_sigterm=plan.checkpoint.dir is not None)
        self.saver = _Saver(step, plan, rank, memory)
        self.metrics = Metrics(step, plan, workload, rank)
        self.lr = step.lr  # the rate of the optimizer step the next micro-batches make
        self.ran = self.total = 0  # micro-batches run, and to run
        self.stopped: signal.Signals | None = None  # the signal the ranks agreed to stop by
        self.started = self.first_done = 0.0
        self.progress = StepProgress()  # (the steps a restart would train again)
        self.restart = 0  # which restart of a launch this run is

    def next_batch(self) -> tuple | None:
        """This rank's next batch; None once every rank has run out at this step (a rank
        that runs out while others go on stops them all: DataExhaustedError)."""
        with workload_code(self.where):
            batch = next(self.batches, None)
        if batch is None:
            self.step.end_of_data()
        return batch

    def first_micro_batch(self) -> None:
        """Run the first micro-batch (it captures and compiles), report the predicted peak to
        the launcher, and print on rank 0 what the compiler did."""
        first = self.next_batch()
        if first is None:
            raise ZeroccError(f"{self.where} yielded no batch")
        self.started = time.perf_counter()
        self._run(first)
        self.first_done = time.perf_counter()
        self.metrics.start_clock()
        step = self.step
        peak = step.predicted_peak_bytes()  # (a pipeline's: over its schedule)
        report(predicted_peak_bytes=peak, local_ranks=ranks_on_this_machine(unknown=1))
        if self.rank == 0:
            print(step.explain(), flush=True)  # explains the program the first step built

    def train(self, steps: int, total: int) -> None:
        """Run micro-batches until ``total`` have run (the first included), the data runs out
        or SIGTERM stops the run; save where the plan says."""
        from tqdm import tqdm

        self.total = total
        bar = {"desc": "train", "unit": "step", "disable": self.rank != 0}
        with tqdm(total=steps, initial=self.done // self.accum, **bar) as progress:
            self.stopped = self._after_micro_batch(progress)
            while (
                not self.stopped and self.ran < total and (batch := self.next_batch()) is not None
            ):
                self._run(batch)
                self.stopped = self._after_micro_batch(progress)
        self.metrics.finish(self.lr)
        self.metrics.close()
        if not self.stopped:
            self.saver.final()

    def _run(self, batch: tuple) -> None:
        from zerocc.runtime.rank import to_device

        loss = float(self.step(*to_device(batch, self.step.device)))
        self.metrics.micro_batch(loss, batch)
        self.ran += 1

    def _after_micro_batch(self, progress) -> signal.Signals | None:
        """Records and saves where a step ended; the signal the run must stop by, if any."""
        if self.step.micro_batches % self.accum:
            return None
        self.progress.note(self.step.micro_batches // self.accum)
        progress.update()
        record = self.metrics.after_step(self.lr)
        if record is not None:
            progress.set_postfix(progress_text(record), refresh=False)
        self.lr = self.step.lr
        stop = self.stop.agreed(self.step)
        self.saver.after_step(stopping=stop is not None)
        return stop

    def report(self, world_size: int) -> None:
        """Rank 0's lines after the run: why it ended, the summary, the eval loss, where the
        checkpoint and the dumps are."""
        step, saver, ran, accum = self.step, self.saver, self.ran, self.accum
        if self.stopped and saver.last is not None:
            print(f"stopped by {self.stopped.name} after micro-batch {step.micro_batches}: "
                  f"{saver.last}; go on with --resume {self.plan.checkpoint.dir}")  # fmt: skip
        elif self.stopped:
            print(f"stopped by {self.stopped.name} after micro-batch {step.micro_batches} "
                  "(nothing saved: no checkpoint folder; --save DIR saves on a stop)")  # fmt: skip
        elif ran < self.total:
            print(f"the data ran out on every rank after {_counted(ran, accum)}")
        last = self.metrics.last
        _print_summary(step.summary(), ran, accum, last, self.started, self.first_done,
                       world_size, step.micro_batches // accum)  # fmt: skip
        if self.metrics.last_eval is not None:
            at, value = self.metrics.last_eval
            print(f"eval loss after step {at} (mean over the held-back batches): {value:.4f}")
        if saver.last is not None and not self.stopped:
            print(f"checkpoint: {saver.last}")
        if (saves := saver.summary()) is not None:
            print(saves)
        if (restarts := restart_summary(self.restart)) is not None:
            print(restarts)
        if step.dump_dir is not None:
            print(f"dumps: {step.dump_dir} (open {step.dump_dir / 'report.html'})")
            if not shutil.which("dot"):
                from zerocc.inspect.dot import GRAPHVIZ_HINT

                print(f"  {GRAPHVIZ_HINT}")


def _restarted(step) -> int:
    """The restart the ranks are at (``zerocc train --max-restarts``): the highest of theirs,
    for a node that replaces a lost one starts its ranks at restart 0 among peers past it. A
    rank its launch started before counts at least 1: torchrun starts a new round without
    counting a restart where the machines changed (``--nnodes MIN:N``)."""
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) or int(started_before())
    if step.comm.world_size == 1:
        return mine
    told = gathered(step.comm, mine, "the ranks' count of restarts", getattr(step, "health", None))
    return max(told)


def _memory_checkpoints(step, plan: Plan) -> MemoryCheckpoints | None:
    """The in-memory checkpoints of a launched run with ``checkpoint.in_memory``, else None."""
    folder = in_memory_folder() if plan.checkpoint.in_memory else None
    if folder is None:
        return None
    ranks_per_machine = ranks_on_this_machine(unknown=step.comm.world_size)
    return MemoryCheckpoints(folder, step.comm, ranks_per_machine)


def _restored_from_memory(step, plan: Plan, memory: MemoryCheckpoints, restart: int) -> bool:
    """Load the snapshots in memory (after a restart, or in the smaller run ``--nproc-min``
    starts) where some machine holds every rank's of a step at least as new as the disk's
    newest checkpoint; whether they were. Snapshots of another number of ranks (a machine
    lost or one more with ``--nnodes MIN:N``, ``--nproc-min``'s fewer ranks) newer than the
    disk's are written out as a checkpoint of ``checkpoint.dir`` first, which the run then
    loads resharded: no step is lost."""
    done, world, everyone = memory.newest()
    on_disk = _newest_on_disk(plan)
    saved = int(on_disk.name.removeprefix(PREFIX)) if on_disk is not None else None
    if done is None or (saved is not None and saved > done):
        return False
    if world != step.comm.world_size:
        if saved != done and plan.checkpoint.dir is not None:
            _write_out(step, plan, memory, (done, world, everyone), restart)
        return False
    fetched = memory.restore(step, done, everyone)
    if step.comm.rank == 0:
        copies = f"; {fetched} rank(s) from a peer's copy" if fetched else ""
        print(f"{_said_by(restart)}every rank starts again from step "
              f"{done} in memory ({memory.folder}{copies})", flush=True)  # fmt: skip
        print(f"resumed from memory at micro-batch {step.micro_batches} ({step.steps} "
              "optimizer steps applied)")  # fmt: skip
    return True


def _write_out(
    step, plan: Plan, memory: MemoryCheckpoints, newest: tuple[int, int, list], restart: int
) -> None:
    """Write the snapshots of another number of ranks (``newest``: what
    :meth:`MemoryCheckpoints.newest` found) out as a checkpoint, saying so; where that fails,
    say why: the restart loads the disk's newest instead."""
    done, world, everyone = newest
    try:
        path = memory.write_out(done, world, everyone, Path(plan.checkpoint.dir),
                                plan.checkpoint.keep)  # fmt: skip
    except CheckpointError as exc:
        if step.comm.rank == 0:
            print(f"{_said_by(restart)}the snapshots of step {done} in memory, of "
                  f"{world} ranks, could not be written out ({exc}): the disk's newest "
                  "checkpoint is loaded instead", flush=True)  # fmt: skip
        return
    if step.comm.rank == 0:
        print(f"{_said_by(restart)}the snapshots of step {done} in memory are of "
              f"{world} ranks, not {step.comm.world_size}: written out to {path} to load "
              "resharded", flush=True)  # fmt: skip


def _said_by(restart: int) -> str:
    """How a line of the restart ``restart`` begins (0: the first attempt of a launch)."""
    return f"zerocc: restart {restart}: " if restart else "zerocc: "


def _newest_on_disk(plan: Plan) -> Path | None:
    folder = Path(plan.checkpoint.dir) if plan.checkpoint.dir else None
    saved = saved_checkpoints(folder) if folder is not None and folder.is_dir() else []
    return saved[-1] if saved else None


def _resume_point(plan: Plan, rank: int, restart: int) -> str | None:
    """Where the ranks start from: after a restart (``zerocc train --max-restarts``, a rank
    died) the newest checkpoint of ``checkpoint.dir`` where it holds one, else
    ``checkpoint.resume``."""
    if not restart:
        return plan.checkpoint.resume
    newest = _newest_on_disk(plan)
    start = str(newest) if newest is not None else plan.checkpoint.resume
    if rank == 0:
        print(f"zerocc: restart {restart}: every rank starts again from "
              f"{start or 'the beginning (no checkpoint saved yet)'}", flush=True)  # fmt: skip
    return start


def _resume(step, path: str, rank: int) -> None:
    notes = step.load(path)
    if rank == 0:
        print(f"resumed from {resolve(path)} at micro-batch {step.micro_batches} ({step.steps} "
              "optimizer steps applied)")  # fmt: skip
        for note in notes:
            print(f"  note: {note}")


def _batches_from(batches: Iterator[tuple], done: int, rank: int, world: int) -> Iterator[tuple]:
    """This rank's batches after the first ``done`` (those a resumed run already trained on)."""
    for skipped in range(done):
        with workload_code(f"batches({rank}, {world})"):
            skipped_to = next(batches, None)
        if skipped_to is None:
            raise ZeroccError(
                f"resume: the workload gives rank {rank} of {world} {skipped} batch(es), the "
                f"checkpoint was saved after {done}"
            )
    return batches


class _Saver:
    """Saves the plan's checkpoints: every ``checkpoint.every`` optimizer steps, at the end
    (unless the last save was of this same step), and when the ranks agree to stop. Saves
    between steps are written in the background where ``checkpoint.async_save`` says (decided
    at the first save); the save on a stop and the last one are waited for."""

    def __init__(self, step, plan: Plan, rank: int, memory: MemoryCheckpoints | None) -> None:
        self.step, self.config, self.rank, self.memory = step, plan.checkpoint, rank, memory
        self.accum = plan.grad_accumulation
        self.last: Path | None = None  # the newest committed checkpoint
        self.background: bool | None = None
        self.saves, self.blocked_s, self.written_s = 0, 0.0, 0.0
        self._saved_at = -1
        self._pending: PendingSave | None = None

    def after_step(self, stopping: bool) -> None:
        """Save where due after an optimizer step: every ``checkpoint.every``, and when the
        run stops on a signal (waited for)."""
        if self.config.dir is None:
            return
        optimizer_steps = self.step.micro_batches // self.accum
        if stopping or (self.config.every and optimizer_steps % self.config.every == 0):
            self._save()
        if stopping:
            self.finish()
        elif self.memory is not None:
            self.memory.save(self.step)  # (the step's state as of now: taken before it goes on)

    def final(self) -> None:
        """The save at the end of the run, waited for."""
        if self.config.dir is not None and self.step.micro_batches % self.accum == 0:
            self._save()
        self.finish()

    def finish(self) -> None:
        """Wait for the save in flight and the in-memory copies in flight (an error, if one
        failed, is raised here)."""
        if self.memory is not None:
            self.memory.wait()
        pending, self._pending = self._pending, None
        if pending is not None:
            self.last = pending.wait()
            self.written_s += pending.times.written_s

    def settle(self) -> None:
        """On the way out, after an error too: let the save in flight commit (a peer that
        left fails it at once) before the process groups close, and the copies to memory in
        flight a few seconds (a peer gone may never answer: MemoryCheckpoints.abandon). Its
        own failure was printed where it happened; the run's error is the one raised."""
        if self.memory is not None:
            self.memory.abandon()
        with contextlib.suppress(Exception):
            self.finish()

    def _save(self) -> None:
        if self._saved_at == self.step.micro_batches:
            return
        self._saved_at = self.step.micro_batches
        self.saves += 1
        if not self._in_background():
            started = time.perf_counter()
            self.last = self.step.save(self.config.dir, keep=self.config.keep)
            self.blocked_s += time.perf_counter() - started
            return
        self.finish()
        self._pending = self.step.save_async(self.config.dir, keep=self.config.keep)
        self.blocked_s += self._pending.times.blocked_s

    def _in_background(self) -> bool:
        if self.background is None:
            setting, why = self.config.async_save, ""
            if setting == "auto":
                setting, why = background_fits(self.step)
            self.background = setting
            if why and self.rank == 0:
                print(f"checkpoint.async_save: auto: saving in the foreground: {why}",
                      flush=True)  # fmt: skip
        return self.background

    def summary(self) -> str | None:
        """A line on the saves: how many, how long training waited for each, how long the
        background writes took; one on the saves to memory; None before any."""
        lines = []
        if self.saves:
            how = "in the background" if self.background else "in the foreground"
            lines.append(f"checkpoints: {self.saves} saved {how}, training blocked "
                         f"{self.blocked_s / self.saves:.2f} s per save")  # fmt: skip
        if self.saves and self.background:
            lines[-1] += f" (written in {self.written_s / self.saves:.2f} s each)"
        memory = self.memory
        if memory is not None and memory.saved_s:
            copied = (
                f", each copied to the next machine on a thread ({memory.copied_s:.2f} s)"
                if memory.copy_to is not None
                else ""
            )
            lines.append(f"checkpoints in memory: every step{copied}, training blocked "
                         f"{memory.saved_s:.2f} s in all")  # fmt: skip
        return "\n".join(lines) or None


def _counted(micro_batches: int, accum: int) -> str:
    """``12 step(s)``; with accumulation ``3 step(s) (12 micro-batches)``."""
    if accum == 1:
        return f"{micro_batches} step(s)"
    return f"{micro_batches // accum} step(s) ({micro_batches} micro-batches)"


def _print_summary(
    summary: dict[str, Any],
    ran: int,
    accum: int,
    last: dict[str, Any] | None,
    started: float,
    first_done: float,
    world: int,
    last_step: int,
) -> None:
    """``ran``: micro-batches run, ``accum`` to an optimizer step; ``last_step``: the number of
    the last optimizer step (a resumed run's count on from its checkpoint's)."""
    later = ran - 1  # the first micro-batch also captured and compiled: timed apart
    what = "step" if accum == 1 else "micro-batch"
    first = f"the first {what} took {first_done - started:.2f} s, capture included"
    if later:
        rate = later / accum / (time.perf_counter() - first_done)
        first = f"{rate:.2f} steps/s after it; " + first
    comm = summary.get("comm_bytes_per_step", {})
    comm_text = ", ".join(f"{kind} {human_bytes(n)}" for kind, n in comm.items()) or "none"
    loss = "none (no optimizer step completed)"
    if last is not None and last.get("loss") is not None:
        loss = f"{last['loss']:.4f} (mean over {world} rank(s), up to step {last['step']})"
    print(
        f"\n{_counted(ran, accum)} on {world} rank(s): {first}\n"
        f"final loss: {loss}\n"
        f"communication per step: {comm_text}\n"
        f"model state per rank: {human_bytes(summary.get('model_state_bytes', 0))}"
    )
    if "pipeline_waiting_share" in summary:
        print(
            f"pipeline: rank 0 waited {summary['pipeline_waiting_share']:.1%} of the last step "
            f"(step {last_step}) for a neighbour; predicted peak "
            f"{human_bytes(summary['predicted_peak_bytes'])}"
        )
    offload = summary.get("offload_bytes_per_step")
    if offload:
        moved = ", ".join(f"{kind} {human_bytes(n)}" for kind, n in sorted(offload.items()))
        print(f"offload traffic per step: {moved}")
    if summary.get("loss_scale") is not None:
        print(
            f"loss scale: {summary['loss_scale']:g}, "
            f"{summary['skipped_steps']} step(s) skipped for overflow"
        )
    elif summary.get("skipped_steps"):
        print(f"{summary['skipped_steps']} step(s) skipped for a non-finite gradient")
