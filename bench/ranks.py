"""One system's ranks: processes the benchmark starts, commands, and whatever they measured.

:class:`SystemRanks` spawns ``world_size`` fresh processes for a system (so resident memory
compares across systems), each joining its own gloo (or NCCL) group on 127.0.0.1. A rank
builds the model, records its resident memory, sets up the system, and then waits on its pipe
for commands: ``("warmup", n)`` and ``("round", n)`` run n optimizer steps and answer their
times and losses (the first round also restarts the memory peaks); ``("finish",)`` answers the
peaks and exits. Between commands a rank blocks on its pipe, so the ranks of the systems not
running use no CPU: the benchmark interleaves systems this way. A rank that fails answers its
traceback; a system that fails, dies or times out is closed and reported, and the others go on.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from typing import Any

from config import BenchConfig


class SystemFailed(Exception):
    """A rank of the system raised, died or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SystemRanks:
    """The parent's handle on one system's rank processes."""

    def __init__(self, name: str, cfg: BenchConfig, timeout: float) -> None:
        self.name, self.cfg, self.timeout = name, cfg, timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(cfg.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, name, cfg, port, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.ready = self._answers()
        except SystemFailed:
            self.close()
            raise

    def command(self, *message: Any) -> list[dict[str, Any]]:
        """Send ``message`` to every rank; their answers, by rank."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except OSError:  # the rank is gone
                raise SystemFailed(self._died(rank)) from None
        return self._answers()

    def _answers(self) -> list[dict[str, Any]]:
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout
        while len(answers) < len(self.conns):
            for rank, conn in enumerate(self.conns):
                if rank in answers or not conn.poll(0.05):
                    continue
                try:
                    status, value = conn.recv()
                except EOFError:
                    raise SystemFailed(self._died(rank)) from None
                if status == "error":
                    raise SystemFailed(f"rank {rank}: {value}")
                answers[rank] = value
            dead = [r for r, p in enumerate(self.procs) if r not in answers and not p.is_alive()]
            if dead and not self.conns[dead[0]].poll(0.5):
                raise SystemFailed(self._died(dead[0]))
            if time.monotonic() > deadline:
                raise SystemFailed(f"no answer within {self.timeout:.0f} s")
        return [answers[r] for r in range(len(self.conns))]

    def _died(self, rank: int) -> str:
        self.procs[rank].join(1)
        return f"rank {rank} died (exit code {self.procs[rank].exitcode})"

    def close(self) -> None:
        """Stop this system's processes (those still alive after 10 s are killed)."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def rank_main(rank: int, name: str, cfg: BenchConfig, port: int, conn: Connection) -> None:
    """A rank process: set up ``name`` on rank ``rank`` and serve the parent's commands."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(cfg.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if cfg.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported
    import torch
    import torch.distributed as dist
    from measure import CommCounter

    torch.set_num_threads(cfg.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated c10d names, per call
    counter = CommCounter().install()  # before any system imports torch.distributed's names
    try:
        conn.send(("ok", _serve_setup(rank, name, cfg, counter, conn)))
    except BaseException as e:
        conn.send(("error", _short_traceback(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _serve_setup(rank: int, name: str, cfg: BenchConfig, counter: Any, conn: Connection) -> Any:
    """Set up, answer 'ready', serve step commands; returns the answer to 'finish'."""
    import torch
    from config import batches
    from measure import peak_rss_bytes, release_free_memory, reset_peak_rss

    runner, device, ready = _set_up(rank, name, cfg)
    conn.send(("ok", ready))
    data = batches(cfg, rank)
    steps, peak_setup = 0, None
    while (message := conn.recv())[0] != "finish":
        phase, n = message
        if phase == "round" and peak_setup is None:  # peaks of the rounds only, not of setup
            peak_setup = peak_rss_bytes()
            reset_peak_rss()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        if phase == "allocated":
            answer = _allocated_step(runner, data, device)
        else:
            answer = _run_steps(runner, data, n, device, counter, profile_last=phase == "warmup")
        steps += n
        conn.send(("ok", answer))
        # An idle rank gives back what its allocators cache, so that all the systems' ranks fit
        # in memory at once; each round starts with an untimed step that takes it back.
        release_free_memory()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "steps": steps,
        "rss_built": ready["rss_built"],
        "peak_rss": peak_rss_bytes(),
        "peak_rss_setup": peak_setup,
        "cuda_max_allocated": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
    }


def _set_up(rank: int, name: str, cfg: BenchConfig) -> tuple[Any, Any, dict[str, Any]]:
    """Join the process group, build the model, set the system up: (runner, device, ready)."""
    import torch
    import torch.distributed as dist
    from config import build_model
    from measure import rss_bytes
    from systems import all_systems

    system = all_systems()[name]
    for module in system.imports:
        importlib.import_module(module)
    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if system.family == "deepspeed":
        sys.modules["deepspeed"].init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend)
    model = build_model(cfg)
    rss_built = rss_bytes()
    started = time.perf_counter()
    runner = system.build(model, cfg, device)
    return runner, device, {"rss_built": rss_built, "setup_s": time.perf_counter() - started}


def _run_steps(runner: Any, data: Any, n: int, device: Any, counter: Any,
               profile_last: bool) -> dict[str, Any]:  # fmt: skip
    """``n`` optimizer steps: their times and losses, and what the last one communicated.
    With ``profile_last``, the last step runs the system's profiled step when it has one."""
    import torch

    answer: dict[str, Any] = {"times": [], "losses": []}
    started = time.perf_counter()
    for i in range(n):
        idx, targets = next(data)
        counter.reset()
        start = time.perf_counter()
        if profile_last and i == n - 1 and runner.profile_step is not None:
            loss, answer["live_tensor_peak"] = runner.profile_step(idx, targets)
        else:
            loss = runner.train_step(idx, targets)
        value = float(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        answer["times"].append(time.perf_counter() - start)
        answer["losses"].append(value)
    answer["wall_s"] = time.perf_counter() - started
    answer["comm"] = counter.snapshot()
    answer["reported"] = runner.reported()
    return answer


def _allocated_step(runner: Any, data: Any, device: Any) -> dict[str, Any]:
    """One more optimizer step with its tensor allocations measured (zerocc's
    ``peak_allocated``: the allocator's peak, whatever code runs the step, every system's
    alike): the most bytes the step holds beyond what was live before it."""
    from systems import cpu_seconds

    from zerocc.runtime.allocations import peak_allocated

    idx, targets = next(data)
    loss, peak = peak_allocated(lambda: float(runner.train_step(idx, targets)), device)
    return {"allocated_peak": peak, "loss": loss, "reported": cpu_seconds()}


def _short_traceback(e: BaseException) -> str:
    """The error and the last frames, enough to tell why a system failed."""
    trace = "".join(traceback.format_exception(e))
    return f"{type(e).__name__}: {e}\n{trace[-3000:]}"
