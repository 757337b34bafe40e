"""What overlapping communication with compute would buy zerocc's ZeRO-3 step: a measurement,
not a feature. zerocc's schedule waits on every all-gather right after issuing it and on every
reduce-scatter right after issuing it (no pass moves them apart yet). This script reorders a
compiled program by hand, the way a prefetch pass would: each all-gather is issued as soon as
the previous unit's gather has arrived (one unit ahead), and each reduce-scatter is waited on
only when the next one is issued (one in flight). Two TrainSteps on the same ranks, one as
compiled and one reordered, take turns; the losses must be identical. Usage::

    python bench/overlap.py              # the benchmark's 31.6M GPT on 2 CPU ranks
    python bench/overlap.py --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace

import torch
import torch.multiprocessing as mp
from config import BenchConfig, batches, build_model
from ranks import free_port
from systems import zerocc_runner
from torch import fx


def reorder(gm: fx.GraphModule) -> None:
    """Prefetch each all-gather by one unit; keep one reduce-scatter in flight."""
    from zerocc.ir import info, op_name

    def calls(name: str) -> list[fx.Node]:
        return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) == name]

    wait_of = {n.args[0]: n for n in calls("zerocc.wait")}
    gathers = [n for n in calls("zerocc.all_gather_start") if info(n).phase != "optimizer"]
    for previous, gather in zip(gathers, gathers[1:], strict=False):
        wait_of[previous].append(gather)  # issued once the previous unit's gather has arrived
    scatters = calls("zerocc.reduce_scatter_start")
    update = next(n for n in gm.graph.nodes if info(n).phase == "optimizer")
    for scatter, following in zip(scatters, [*scatters[1:], update], strict=True):
        wait = wait_of[scatter]
        users = list(wait.users)  # the add_ into the gradient shard
        following.prepend(wait)
        for user in users:
            following.prepend(user)
    gm.graph.lint()
    gm.recompile()


def compare_rank(rank: int, cfg: BenchConfig, port: int, steps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    runs = {
        "as compiled": (zerocc_runner(build_model(cfg), cfg, device, stage=3), batches(cfg, rank)),
        "reordered": (zerocc_runner(build_model(cfg), cfg, device, stage=3), batches(cfg, rank)),
    }
    losses: dict[str, list[float]] = {name: [] for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, (runner, data) in runs.items():  # compiles the program
        losses[name].append(float(runner.train_step(*next(data))))
    step = runs["reordered"][0].train_step
    for program in step.programs.values():
        reorder(program.gm)
        program.run = step.backend(program.gm)
    for _ in range(1 + steps):  # the first of each is not timed
        for name, (runner, data) in runs.items():
            start = time.perf_counter()
            losses[name].append(float(runner.train_step(*next(data))))
            times[name].append(time.perf_counter() - start)
    peaks = {name: runner.profile_step(*next(data))[1] for name, (runner, data) in runs.items()}
    if rank == 0:
        same = losses["as compiled"] == losses["reordered"]
        print(f"zerocc-z3, GPT {cfg.n_layer}×{cfg.n_embd}, {cfg.world_size} ranks; "
              f"losses identical: {same}")  # fmt: skip
        for name in runs:
            print(f"  {name:<12} median step {1e3 * statistics.median(times[name][1:]):7.1f} ms, "
                  f"peak live tensors {peaks[name] / 2**20:6.1f} MiB")  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7, help="timed steps per program")
    p.add_argument("--layers", type=int, default=BenchConfig.n_layer)
    p.add_argument("--embd", type=int, default=BenchConfig.n_embd)
    args = p.parse_args(argv)
    cfg = BenchConfig(n_layer=args.layers, n_embd=args.embd)
    cfg = replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.world_size))
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    mp.spawn(compare_rank, args=(cfg, free_port(), args.steps), nprocs=cfg.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
