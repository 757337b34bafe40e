"""What the overlap pass buys: zerocc with overlap off and on, same ranks, same batches.

For each ZeRO stage asked for, every rank compiles the benchmark's GPT twice, once with
``overlap.enabled: false`` (each collective waited on right after it is issued) and once with
the overlap pass under a memory budget (``overlap.max_inflight_mb``). The two take turns step by
step (A B, then B A) so that drift of the machine falls on both alike. Per step it records:

- **step ms**: wall time of the step, the slower rank's;
- **exposed ms**: time the step spent blocked in waits (``step.comm.stats.blocked_s``), the
  communication the schedule did not hide, the slower rank's;
- **peak live MiB**: the peak bytes of live tensors over one step measured by ``step.profile()``,
  and its growth over overlap off, held against the budget.

The losses of both programs must be identical, step by step. Usage::

    python bench/overlap.py                      # stages 3 and 2, budget 64 MB
    python bench/overlap.py --stages 3 --budget-mb 16 --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from config import BenchConfig, batches, build_model
from ranks import free_port
from report import write_json
from systems import zerocc_runner

MIB = 2**20
RESULTS = Path(__file__).parent / "results"


def _slowest(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure_stage(cfg: BenchConfig, stage: int, budget_mb: float, steps: int) -> dict[str, Any]:
    """One stage on this rank: both programs, interleaved; figures as the slower rank's."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    settings = {"off": {"enabled": False}, "on": {"max_inflight_mb": budget_mb}}
    device = torch.device("cpu")
    runs = {
        name: (zerocc_runner(build_model(cfg), cfg, device, stage=stage, overlap=overlap),
               batches(cfg, rank))
        for name, overlap in settings.items()
    }  # fmt: skip
    figures: dict[str, dict[str, list[float]]] = {
        name: {"step_ms": [], "exposed_ms": [], "loss": []} for name in runs
    }
    for i in range(cfg.warmup + steps):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            runner, data = runs[name]
            batch = next(data)
            dist.barrier()
            began = time.perf_counter()
            loss = float(runner.train_step(*batch))
            elapsed = _slowest(time.perf_counter() - began)
            exposed = _slowest(runner.train_step.comm.stats.blocked_s)
            figures[name]["loss"].append(loss)
            if i >= cfg.warmup:
                figures[name]["step_ms"].append(1e3 * elapsed)
                figures[name]["exposed_ms"].append(1e3 * exposed)
    out: dict[str, Any] = {"stage": stage, "budget_mb": budget_mb}
    for name, (runner, data) in runs.items():
        _, peak = runner.profile_step(*next(data))
        out[name] = {
            "step_ms": statistics.median(figures[name]["step_ms"]),
            "exposed_ms": statistics.median(figures[name]["exposed_ms"]),
            "peak_live_bytes": _slowest(peak),
            "losses": figures[name]["loss"],
        }
    out["losses_identical"] = figures["on"]["loss"] == figures["off"]["loss"]
    return out


def bench_rank(rank: int, cfg: BenchConfig, port: int, args: argparse.Namespace, path: Path):
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = [measure_stage(cfg, s, args.budget_mb, args.steps) for s in args.stages]
    if rank == 0:
        print(table(cfg, results))
        write_json(path, {"config": cfg.__dict__, "steps": args.steps, "results": results})
        print(f"\nwritten: {path}")
    dist.destroy_process_group()


def table(cfg: BenchConfig, results: list[dict[str, Any]]) -> str:
    lines = [
        f"zerocc, GPT {cfg.n_layer}×{cfg.n_embd}, {cfg.world_size} gloo ranks × {cfg.threads} "
        "thread; medians of the timed steps, the slower rank's",
        "",
        f"{'stage':<6}{'overlap':<9}{'step ms':>9}{'exposed ms':>12}{'peak live MiB':>15}"
        f"{'Δ peak MiB':>12}{'budget MiB':>12}  losses",
    ]
    for r in results:
        for name in ("off", "on"):
            m = r[name]
            growth = (m["peak_live_bytes"] - r["off"]["peak_live_bytes"]) / MIB
            lines.append(
                f"{r['stage']:<6}{name:<9}{m['step_ms']:>9.1f}{m['exposed_ms']:>12.1f}"
                f"{m['peak_live_bytes'] / MIB:>15.1f}{growth:>12.1f}"
                f"{r['budget_mb'] if name == 'on' else '':>12}"
                f"  {'identical' if r['losses_identical'] else 'DIFFER'}"
            )
        on, off = r["on"], r["off"]
        exposed = on["exposed_ms"] / off["exposed_ms"] if off["exposed_ms"] else float("nan")
        lines.append(
            f"      on/off: step {on['step_ms'] / off['step_ms']:.2f}×, exposed {exposed:.2f}× "
            "(targets: step < 1, exposed ≤ 0.50, Δ peak ≤ budget)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 2], choices=range(4))
    p.add_argument("--budget-mb", type=float, default=64, help="overlap.max_inflight_mb")
    p.add_argument("--steps", type=int, default=16, help="timed steps per program")
    p.add_argument("--layers", type=int, default=BenchConfig.n_layer)
    p.add_argument("--embd", type=int, default=BenchConfig.n_embd)
    args = p.parse_args(argv)
    cfg = BenchConfig(n_layer=args.layers, n_embd=args.embd)
    cfg = replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.world_size))
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"overlap-cpu-{stamp}.json"
    mp.spawn(bench_rank, args=(cfg, free_port(), args, path), nprocs=cfg.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
