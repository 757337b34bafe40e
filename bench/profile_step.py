"""Where one system's training step spends its time: the profile behind BENCHMARKS.md's
"where zerocc is behind". Runs a system of bench/compare.py on its ranks (same model, data and
threads), takes a few steps, then profiles one step with ``torch.profiler`` and prints rank 0's
busiest ops; for zerocc also its own op-by-op run (``step.profile``): time per op kind on the
compute track, and per collective from issue to the end of its wait on the comm track. Usage::

    python bench/profile_step.py zerocc-z3
    python bench/profile_step.py fsdp2-z3 --layers 4 --rows 30
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch
import torch.multiprocessing as mp
from config import BenchConfig, batches, build_model
from ranks import free_port
from systems import all_systems


def profile_rank(rank: int, name: str, cfg: BenchConfig, port: int, rows: int) -> None:
    """One rank: set up ``name``, take 3 steps, profile the 4th (and, for zerocc, a 5th)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    system = all_systems()[name]
    if system.family == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    runner = system.build(build_model(cfg), cfg, torch.device("cpu"))
    data = batches(cfg, rank)
    for _ in range(3):
        runner.train_step(*next(data))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.train_step(*next(data))
    if rank == 0:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        print(f"{name}: one step under torch.profiler, rank 0\n{table}")
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
    args = p.parse_args(argv)
    cfg = BenchConfig(n_layer=args.layers, n_embd=args.embd)
    cfg = replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.world_size))
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    port = free_port()
    mp.spawn(profile_rank, args=(args.system, cfg, port, args.rows), nprocs=cfg.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
