"""Quantized collectives (issue 51: ``zero.quantized_weights``, ``zero.quantized_grads``) against
the same run without: bytes per step and the loss curve over a few hundred steps of the example
GPT.

Two gloo ranks (1 thread each) train the example GPT on its text at ZeRO-3: fp32 as it is, with
int8 weight gathers (w8), fp8 ones (wf8), int8 gradient exchanges (g8), int4 ones (g4) and w8 +
g8, and bf16 as it is, with w8 + g8 and with wf8 + g4. Each rank's batches are the same in
every run. Reported per run: bytes per step by collective (counted at the calls: a
reduce-scatter counts its whole input, the quantized exchange's all-to-all what leaves the
rank), median wall and CPU time per step, and the loss curve (mean of
both ranks' losses, smoothed over 20 steps) beside its unquantized twin's: the largest
difference of the smoothed curves, and the final smoothed loss. Prints a table; writes
``bench/results/quantized-cpu-<date>.json`` and a plot of the curves beside it::

    python bench/quantized.py              # 300 steps, ~4 minutes here
    python bench/quantized.py --steps 100
    python bench/quantized.py --float8 --layers 2 --embd 64 --block 32 --batch 4   # ~17 min
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from compare import machine
from config import BenchConfig, build_model, data, model_name
from ranks import free_port
from report import write_json

RESULTS = Path(__file__).resolve().parent / "results"
SMOOTH = 20  # steps in the moving mean of a loss curve
RUNS = {  # name -> (precision section, quantized_weights, quantized_grads, the run it is beside)
    "fp32": ({}, "none", "none", "fp32"),
    "fp32 w8": ({}, "int8", "none", "fp32"),
    "fp32 wf8": ({}, "fp8", "none", "fp32"),
    "fp32 g8": ({}, "none", "int8", "fp32"),
    "fp32 g4": ({}, "none", "int4", "fp32"),
    "fp32 w8 g8": ({}, "int8", "int8", "fp32"),
    "bf16": ({"param": "bf16"}, "none", "none", "bf16"),
    "bf16 w8 g8": ({"param": "bf16"}, "int8", "int8", "bf16"),
    "bf16 wf8 g4": ({"param": "bf16"}, "fp8", "int4", "bf16"),
}
# --float8: the linear layers multiplied in float8 (precision.matmul: fp8, torchao's layers) beside
# the same runs without; on a CPU torch's reference _scaled_mm is ~1000x slower than an fp32
# matmul, so these run on a smaller GPT (--layers 2 --embd 64 --block 32 --batch 4: ~1 s a step)
FLOAT8_RUNS = {
    "fp32": ({}, "none", "none", "fp32"),
    "fp32 mm8": ({"matmul": "fp8"}, "none", "none", "fp32"),
    "fp32 mm8 rowwise": ({"matmul": "fp8", "fp8": {"recipe": "rowwise"}}, "none", "none", "fp32"),
    "bf16": ({"param": "bf16"}, "none", "none", "bf16"),
    "bf16 mm8": ({"param": "bf16", "matmul": "fp8"}, "none", "none", "bf16"),
}


def plan_of(cfg: BenchConfig, precision: dict, weights: str, grads: str) -> dict[str, Any]:
    return {
        "zero": {"stage": 3, "quantized_weights": weights, "quantized_grads": grads},
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": cfg.lr, "eps": cfg.eps,
                      "weight_decay": cfg.weight_decay},
        "precision": precision,
        "backend": {"name": "eager", "device": "cpu", "kernels": "torch"},
        "seed": cfg.seed,
    }  # fmt: skip


def rank_main(
    rank: int, cfg: BenchConfig, port: int, steps: int, out: Any, runs: dict[str, tuple]
) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist

    import zerocc

    dist.init_process_group("gloo")
    results = {}
    for name, (precision, weights, grads, _) in runs.items():
        step = zerocc.compile(build_model(cfg), plan_of(cfg, precision, weights, grads))
        batches = data.batches(rank, cfg.world_size, batch_size=cfg.batch_size,
                               block_size=cfg.block_size, seed=cfg.seed)  # fmt: skip
        losses, wall, cpu = [], [], []
        for _, batch in zip(range(steps), batches, strict=False):
            start, start_cpu = time.perf_counter(), time.process_time()
            losses.append(float(step(*batch)))
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        results[name] = {"losses": losses, "wall_s": wall, "cpu_s": cpu,
                         "bytes": dict(step.comm.stats.bytes)}  # fmt: skip
        del step
    out.put((rank, results))
    dist.destroy_process_group()


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(losses))]


def summarize(per_rank: list[dict[str, Any]], plans: dict[str, tuple]) -> dict[str, Any]:
    runs = {}
    for name in plans:
        curves = [r[name]["losses"] for r in per_rank]
        mean = [statistics.fmean(x) for x in zip(*curves, strict=True)]
        first = per_rank[0][name]
        runs[name] = {
            "curve": mean,
            "smoothed": smoothed(mean),
            "all_gather_bytes": first["bytes"].get("all_gather", 0),
            # (the quantized exchange's all-to-all counts what leaves the rank; a reduce-scatter
            # counts its whole input)
            "reduce_scatter_bytes": first["bytes"].get("reduce_scatter", 0),
            "all_to_all_bytes": first["bytes"].get("all_to_all", 0),
            "wall_s": statistics.median(first["wall_s"][2:]),
            "cpu_s": statistics.median(first["cpu_s"][2:]),
        }
    for name, run in runs.items():
        twin = runs[plans[name][3]]
        run["max_smoothed_difference"] = max(
            abs(a - b) for a, b in zip(run["smoothed"], twin["smoothed"], strict=True)
        )
        run["gather_bytes_ratio"] = run["all_gather_bytes"] / twin["all_gather_bytes"]
    return runs


def table(runs: dict[str, Any]) -> str:
    lines = [f"{'run':<12}{'all-gather/step':>17}{'ratio':>7}{'reduce-scatter':>16}"
             f"{'all-to-all':>14}{'wall':>9}{'cpu':>9}{'final loss':>12}"
             f"{'max |Δ| vs twin':>17}"]  # fmt: skip
    for name, r in runs.items():
        lines.append(
            f"{name:<12}{r['all_gather_bytes'] / 2**20:>13.2f}MiB{r['gather_bytes_ratio']:>7.3f}"
            f"{r['reduce_scatter_bytes'] / 2**20:>12.2f}MiB"
            f"{r['all_to_all_bytes'] / 2**20:>10.2f}MiB{1e3 * r['wall_s']:>7.1f}ms"
            f"{1e3 * r['cpu_s']:>7.1f}ms{r['smoothed'][-1]:>12.4f}"
            f"{r['max_smoothed_difference']:>17.4f}"
        )
    return "\n".join(lines)


def plot(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(r["smoothed"], label=name, linestyle="--" if " " in name else "-")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of the ranks, smoothed over {SMOOTH} steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--block", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--float8", action="store_true",
                   help="float8 matmuls (precision.matmul: fp8) beside the runs without")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and the plot")
    args = p.parse_args(argv)
    cfg = replace(BenchConfig(n_layer=args.layers, n_embd=args.embd, n_head=4,
                              block_size=args.block, batch_size=args.batch), threads=1)
    plans = FLOAT8_RUNS if args.float8 else RUNS
    os.environ["OMP_NUM_THREADS"] = "1"
    info = machine(cfg)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    ranks = mp.spawn(rank_main, args=(cfg, free_port(), args.steps, out, plans),
                     nprocs=cfg.world_size, join=False)  # fmt: skip
    # (read before joining: a result larger than the pipe's buffer blocks its rank until read)
    per_rank = [r for _, r in sorted(out.get() for _ in range(cfg.world_size))]
    while not ranks.join():
        pass
    runs = summarize(per_rank, plans)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"{'float8' if args.float8 else 'quantized'}-cpu-{stamp}.json"
    write_json(path, {"machine": info, "config": asdict(cfg), "steps": args.steps, "runs": runs})
    plot(runs, path.with_suffix(".png"))
    print(f"{model_name(cfg)}, {cfg.world_size} gloo ranks × 1 thread, {args.steps} steps, "
          f"{info['date']}, commit {info['commit']}\n{table(runs)}\nwrote {path} and its "
          "plot")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
