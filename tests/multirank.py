"""Run a function on N local ranks (spawned processes) and collect what each returns.

Ranks join a gloo group by default: CPU ranks, whose plans say ``backend.device: cpu`` (on a
machine with a GPU, ``auto`` would put them on CUDA) and whose Triton kernels run interpreted
(``TRITON_INTERPRET=1`` set for them, whatever this process has). ``backend="nccl"`` gives each
rank the GPU ``cuda:rank`` (tests marked ``cuda``/``two_gpus``, see conftest.py).

A rank that raises sends its error back; a run that outlives its timeout is killed and fails
the test: a hang never reaches CI.
"""

from __future__ import annotations

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


def _worker(
    rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue: mp.Queue
) -> None:
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, queue))
        for r in range(world)
    ]
    # Spawned ranks inherit this environment when they start (and read it as they import).
    with environment({"TRITON_INTERPRET": "1"} if backend == "gloo" else {}):
        for p in procs:
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
