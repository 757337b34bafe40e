"""Run a function on N local ranks (spawned processes) and collect what each returns.

Ranks join a gloo group by default: CPU ranks, whose plans say ``backend.device: cpu`` (on a
machine with a GPU, ``auto`` would put them on CUDA) and whose Triton kernels run interpreted
(``TRITON_INTERPRET=1`` set for them, whatever this process has). ``backend="nccl"`` gives each
rank the GPU ``cuda:rank`` (tests marked ``cuda``/``two_gpus``, see conftest.py).

CPU ranks are forked from a server process that has imported torch and zerocc once
(multiprocessing's ``forkserver``): a spawned rank spent ~2.5 s of CPU importing them, ~6
minutes of the suite on 2 cores. A forked rank starts with this process's environment as of
the call (not the server's), so what a test sets for its ranks reaches them. GPU ranks are
spawned (CUDA does not survive a fork).

A rank that raises sends its error back; a run that outlives its timeout is killed and fails
the test: a hang never reaches CI.
"""

from __future__ import annotations

import functools
import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from zerocc.runtime.launch import environment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the server imports before it forks any rank (zerocc.runtime.step: the TrainStep and
# what compiling imports; torch._dynamo: capture's; transformers' modeling code, ~3 s of CPU
# in each rank that builds one of the Hugging Face models of tests/models.py, once here).
PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "zerocc", "zerocc.runtime.step",
             "transformers.models.mixtral.modeling_mixtral"]  # fmt: skip


def _context(backend: str) -> Any:
    """Where ranks start from: the forkserver for CPU ranks, spawn for GPU ranks."""
    return _forkserver() if backend == "gloo" else mp.get_context("spawn")


@functools.cache
def _forkserver() -> Any:
    """The forkserver context, its server started once, with ``TRITON_INTERPRET=1`` set
    before it imports triton."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    with environment({"TRITON_INTERPRET": "1"}):
        forkserver.ensure_running()
    return ctx


def _worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    fn: Callable,
    args: tuple,
    queue: mp.Queue,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # (a forked rank holds the server's environment: the caller's instead)
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        # Serialized here: tensors sent through the queue as shared memory die with the rank.
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as e:  # report every failure, typed, to the test process
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    world: int, fn: Callable, *args: Any, timeout: float = 600, backend: str = "gloo"
) -> list[Any]:
    """``fn(rank, world, *args)`` on each of ``world`` ranks of a ``backend`` group (gloo: CPU
    ranks; nccl: rank i on cuda:i); returns results by rank.

    Raises RuntimeError with the first rank's traceback if any rank failed; ``errors`` of that
    exception holds (type name, message) per failed rank.
    """
    ctx = _context(backend)
    queue = ctx.Queue()
    port = _free_port()
    with environment({"TRITON_INTERPRET": "1"} if backend == "gloo" else {}):
        environ = dict(os.environ)
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, queue, environ))
            for r in range(world)
        ]
        for p in procs:  # (spawned ranks inherit this environment and read it as they import)
            p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = queue.get(timeout=1.0)
                results[rank] = (status, value)
                continue
            except queue_module.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                why = (
                    f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                    if dead
                    else f"ranks still running after {timeout:.0f}s"
                )
                raise RuntimeError(f"multi-rank run failed: {why}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        first = errors[min(errors)]
        err = RuntimeError(f"rank {min(errors)} failed: {first[0]}: {first[1]}\n{first[2]}")
        err.errors = {r: v[:2] for r, v in errors.items()}
        raise err
    import torch

    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world)]
