"""Where one system's training step spends its time: the profile behind BENCHMARKS.md's
"where zerocc is behind". Runs a system of bench/compare.py on its ranks (same model, data and
threads), takes a few steps, then profiles one step with ``torch.profiler`` and prints rank 0's
busiest ops; for zerocc also its own op-by-op run (``step.profile``): time per op kind on the
compute track, and per collective from issue to the end of its wait on the comm track. On a
CPU it prints the step's time in matmul kernels and outside them: the CPU time of unprofiled
steps (the median of ``UNPROFILED``) less the profiled step's matmul kernels. Not the profiled
step's own time, which holds the profiler's overhead; and the steps after it are not like those
before: in one process on the benchmark GPT, 99 minor page faults a step before it and 25-46k
after, glibc serving the large buffers from fresh pages, where the packing took 15-31 ms a step
against 7. Usage::

    python bench/profile_step.py zerocc-z3
    python bench/profile_step.py fsdp2-z3 --layers 4 --rows 30
    python bench/profile_step.py zerocc-z3-inductor --gpu --trace /tmp/trace.json

``--gpu``: compare.py's GPU configuration (one GPU, bf16, NCCL, the 354M GPT); ops are ranked
by their GPU time, and the step's wall time is printed beside the sum of its GPU kernels' times
(how much of the step the GPU spends computing rather than waiting for the host).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch
import torch.multiprocessing as mp
from config import GPU, BenchConfig, batches, build_model
from ranks import free_port
from systems import all_systems

# The matmul kernels no compiler shortens: the step's time outside them is what Inductor can
# win (issue 18's CPU goal: at most half of the eager backend's).
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
UNPROFILED = 5  # steps timed before the profiled one


def profile_rank(rank: int, name: str, cfg: BenchConfig, port: int, rows: int,
                 trace: str | None) -> None:  # fmt: skip
    """One rank: set up ``name``, take 3 steps, profile the 4th (and, for zerocc, a 5th)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpu = cfg.device == "cuda"
    if not gpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    system = all_systems()[name]
    if system.family == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo")
    else:
        dist.init_process_group("nccl" if gpu else "gloo")
    runner = system.build(build_model(cfg), cfg, device)
    data = batches(cfg, rank)
    for _ in range(3):
        runner.train_step(*next(data))
    cpu_ms = []  # this rank's CPU time per unprofiled step, all its threads
    for _ in range(UNPROFILED):
        start = time.process_time()
        runner.train_step(*next(data))
        cpu_ms.append((time.process_time() - start) * 1e3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    synchronize = torch.cuda.synchronize if gpu else (lambda: None)
    synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        runner.train_step(*next(data))
        synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    if rank == 0:
        sort_by = "self_cuda_time_total" if gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=rows)
        print(f"{name}: one step under torch.profiler, rank 0\n{table}")
        if not gpu:
            matmuls_ms = (
                sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMULS) / 1e3
            )
            step_ms = statistics.median(cpu_ms)
            print(
                f"step {step_ms:.1f} ms CPU (median of {UNPROFILED} unprofiled; profiled "
                f"{wall_ms:.1f} ms wall): matmuls {matmuls_ms:.1f} ms, outside matmuls "
                f"{step_ms - matmuls_ms:.1f} ms"
            )
        if gpu:
            kernels = [
                e for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation
            ]  # fmt: skip
            kernels_ms = sum(e.self_device_time_total for e in kernels) / 1e3
            print(f"step {wall_ms:.1f} ms wall (profiled), GPU kernels {kernels_ms:.1f} ms")
        if trace:
            prof.export_chrome_trace(trace)
    if runner.profile_step is not None:
        step = runner.train_step  # zerocc's TrainStep
        _, recorder = step.profile(*next(data))
        if rank == 0:
            print(f"{name}: step.profile, rank 0, ms per op kind\n{_by_kind(recorder.events)}")
    dist.destroy_process_group()


def _by_kind(events: list[Any]) -> str:
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for e in events:
        totals[(e.track, e.name.split(" ")[0])] += e.duration_us / 1e3
    ordered = sorted(totals.items(), key=lambda kv: -kv[1])
    return "\n".join(f"  {track:<8}{kind:<50}{ms:>9.1f}" for (track, kind), ms in ordered[:25])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("system", choices=list(all_systems()))
    p.add_argument("--layers", type=int, default=BenchConfig.n_layer)
    p.add_argument("--embd", type=int, default=BenchConfig.n_embd)
    p.add_argument("--rows", type=int, default=20, help="ops listed")
    p.add_argument("--gpu", action="store_true", help="compare.py's GPU configuration")
    p.add_argument("--trace", help="write rank 0's Chrome trace of the profiled step here")
    args = p.parse_args(argv)
    if args.gpu:
        cfg = replace(BenchConfig(), **GPU)
    else:
        cfg = BenchConfig(n_layer=args.layers, n_embd=args.embd)
    cfg = replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.world_size))
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    port = free_port()
    mp.spawn(
        profile_rank, args=(args.system, cfg, port, args.rows, args.trace), nprocs=cfg.world_size
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
