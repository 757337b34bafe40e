"""Does `zerocc plan auto` rank plans as they run? Predicted against measured, plan by plan.

For each world size asked for (2 and 4 gloo ranks by default, 1 thread each), fresh ranks:

1. calibrate the cost model on one plan (ZeRO-2) with the code behind ``zerocc profile``;
2. train every candidate plan of the search (ZeRO stages 0-3 × recompute none/all, and on 4
   ranks × tensor parallelism 1, 2, 4: the example GPT's Megatron split), each a few steps
   after a warm-up, timed as they run (a step lasts as long as its slowest rank; the CPU time
   of rank 0 beside it), and one step profiled for its measured peak memory.

Then the search is run with that calibration (`zerocc.inspect.plan_search.search_plans`, on fake
tensors) and each candidate's predicted time per token set beside its measured one. Reported:
the rank correlation (Spearman) of predicted and measured time per token (target ≥ 0.8), whether
the search's pick is within 10% of the measured best, and whether the pick's measured peak is
within its prediction. A tensor-parallel group trains one batch, so plans are compared by time
per token, not per step. Prints a table; writes ``bench/results/plan_search-cpu-<date>.json``::

    python bench/plan_search.py                   # 2 and 4 ranks, 32 plans, ~10 minutes here
    python bench/plan_search.py --worlds 2 --steps 3
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
import yaml
from compare import machine
from config import EXAMPLE, BenchConfig, build_model, data, model_name
from ranks import free_port
from report import write_json

RESULTS = Path(__file__).resolve().parent / "results"
CORRELATION_TARGET = 0.8
PICK_TARGET = 0.10  # the pick's measured time per token within 10% of the measured best
# the example GPT's Megatron split, as examples/gpt/zero3-tp.yaml gives it
TP_LAYERS = yaml.safe_load((EXAMPLE / "zero3-tp.yaml").read_text())["parallel"]["tp_layers"]


def base_plan(cfg: BenchConfig) -> dict[str, Any]:
    """What the search starts from: units, optimizer, and the layers tp may split; the stage,
    recomputation and tp degree are searched."""
    plan: dict[str, Any] = {
        "units": {"classes": ["Block"]},
        "optimizer": {"name": "adamw", "lr": cfg.lr, "eps": cfg.eps,
                      "weight_decay": cfg.weight_decay},
        "backend": {"name": "eager", "device": "cpu", "kernels": "torch"},
        "seed": cfg.seed,
    }  # fmt: skip
    if cfg.world_size > 2:
        plan["parallel"] = {"tp_layers": TP_LAYERS}
    return plan


def candidates(cfg: BenchConfig) -> list[dict[str, Any]]:
    """The plans measured: the search's candidates for this world (its space, here)."""
    from zerocc.compiler.plan import load_plan
    from zerocc.inspect.plan_search import candidate_fields, search_space

    space, _ = search_space(load_plan(base_plan(cfg)), "cpu", cfg.world_size)
    return list(candidate_fields(space))


def plan_with(cfg: BenchConfig, fields: dict[str, Any]) -> Any:
    from zerocc.compiler.driver.plan_changes import derive_plan
    from zerocc.compiler.plan import load_plan

    return derive_plan(load_plan(base_plan(cfg)), fields)


def _endless(cfg: BenchConfig, data_rank: int, data_ranks: int):
    while True:
        yield from data.batches(data_rank, data_ranks, batch_size=cfg.batch_size,
                                block_size=cfg.block_size, seed=cfg.seed)  # fmt: skip


def world_rank(rank: int, cfg: BenchConfig, port: int, steps: int, out: Any) -> None:
    """One rank: calibrate on ZeRO-2, then train and time every candidate plan."""
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size),
                      LOCAL_WORLD_SIZE=str(cfg.world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist

    import zerocc
    from zerocc.inspect.calibrate import calibrate
    from zerocc.inspect.link_rates import slowest

    dist.init_process_group("gloo")
    step = zerocc.compile(build_model(cfg), plan_with(cfg, {"zero.stage": 2}))
    calibration = calibrate(step, _endless(cfg, step.data_rank, step.data_parallel),
                            steps=steps, warmup=cfg.warmup)  # fmt: skip
    del step
    rows = []
    for fields in candidates(cfg):
        step = zerocc.compile(build_model(cfg), plan_with(cfg, fields))
        batches = _endless(cfg, step.data_rank, step.data_parallel)
        for _ in range(cfg.warmup):
            float(step(*next(batches)))
        wall, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            float(step(*next(batches)))
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        wall = slowest(step.comm, wall, step.device)
        _, recorder = step.profile(*next(batches))
        peak = max(slowest(step.comm, [float(recorder.timeline.peak()[1])], step.device))
        tokens = step.data_parallel * cfg.batch_size * cfg.block_size
        rows.append({"fields": fields, "wall_s": wall, "cpu_s": cpu, "peak": int(peak),
                     "tokens": tokens})  # fmt: skip
        del step
    if rank == 0:
        out.put({"rates": calibration.rates.as_dict(), "rows": rows})
    dist.destroy_process_group()


def run_world(cfg: BenchConfig, steps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    ranks = mp.spawn(world_rank, args=(cfg, free_port(), steps, out), nprocs=cfg.world_size,
                     join=False)  # fmt: skip
    result = out.get()  # (before joining: a result larger than the pipe's buffer blocks rank 0)
    while not ranks.join():
        pass
    return result


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties given their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def compare(cfg: BenchConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The search with the world's calibration, each candidate beside its measurement."""
    from zerocc.compiler.plan import load_plan
    from zerocc.compiler.workload import Workload
    from zerocc.cost.rates import DeviceRates
    from zerocc.inspect.plan_search import search_plans

    workload = Workload(
        build_model(cfg),
        batches=lambda rank, world: _endless(cfg, rank, world),
        tokens_per_batch=lambda batch: batch[0].numel(),
    )
    rates = DeviceRates(**measured["rates"])
    search = search_plans(load_plan(base_plan(cfg)), cfg.world_size, 2**62, rates, workload,
                          exhaustive=True)  # (every candidate's prediction, to compare)
    # (the measured grid is the search's space without every-other-unit recompute, whose list
    # of units is no dict key: those predictions are left out of the comparison)
    predicted = {
        tuple(sorted(c.fields.items())): c
        for c in search.candidates
        if not any(isinstance(v, list) for v in c.fields.values())
    }
    rows = []
    for row in measured["rows"]:
        c = predicted[tuple(sorted(row["fields"].items()))]
        wall = statistics.median(row["wall_s"])
        rows.append({
            **row,
            "plan": c.describe(),
            "measured_s_per_token": wall / row["tokens"],
            "predicted_s_per_token": c.seconds_per_work,
            "measured_step_s": wall,
            "cpu_step_s": statistics.median(row["cpu_s"]),
            "predicted_step_s": c.step_s,
            "predicted_peak": c.peak,
        })  # fmt: skip
    rho = spearman([r["predicted_s_per_token"] for r in rows],
                   [r["measured_s_per_token"] for r in rows])  # fmt: skip
    best_measured = min(r["measured_s_per_token"] for r in rows)
    pick = next(r for r in rows if r["plan"] == search.best.describe())
    return {
        "world_size": cfg.world_size,
        "rows": sorted(rows, key=lambda r: r["measured_s_per_token"]),
        "spearman": rho,
        "pick": pick["plan"],
        "pick_over_best": pick["measured_s_per_token"] / best_measured - 1,
        "pick_peak_within_prediction": pick["peak"] <= pick["predicted_peak"],
        "rates": measured["rates"],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['world_size']} ranks: {len(result['rows'])} plans, Spearman "
        f"{result['spearman']:.2f} (target ≥ {CORRELATION_TARGET}); pick {result['pick']}: "
        f"{100 * result['pick_over_best']:+.0f}% of the measured best (target ≤ "
        f"{100 * PICK_TARGET:.0f}%); its measured peak within the prediction: "
        f"{result['pick_peak_within_prediction']}",
        f"  {'measured':>9} {'cpu':>8} {'predicted':>10}  {'µs/token':>17}  "
        f"{'peak meas/pred':>19}  plan",
    ]
    for r in result["rows"]:
        lines.append(
            f"  {1e3 * r['measured_step_s']:>7.1f}ms {1e3 * r['cpu_step_s']:>6.1f}ms "
            f"{1e3 * r['predicted_step_s']:>8.1f}ms  {1e6 * r['measured_s_per_token']:>7.2f} / "
            f"{1e6 * r['predicted_s_per_token']:<7.2f}  {r['peak'] / 2**20:>8.1f} / "
            f"{r['predicted_peak'] / 2**20:<6.1f}MiB  {r['plan']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args(argv)
    # vocabulary 68: the text's 65 characters padded to a multiple of tp 4
    base = BenchConfig(n_layer=args.layers, n_embd=args.embd, vocab_size=68, threads=1)
    os.environ["OMP_NUM_THREADS"] = "1"
    info = machine(base)
    results = []
    for world in args.worlds:
        cfg = replace(base, world_size=world)
        results.append(compare(cfg, run_world(cfg, args.steps)))
        print(table(results[-1]), flush=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"plan_search-cpu-{stamp}.json"
    write_json(path, {"machine": info, "config": asdict(base), "worlds": results})
    print(f"\n{model_name(base)}, gloo ranks × 1 thread, {info['date']}, commit "
          f"{info['commit']}; {args.steps} timed steps per plan\nwrote {path}")  # fmt: skip
    met = all(
        r["spearman"] >= CORRELATION_TARGET and r["pick_over_best"] <= PICK_TARGET for r in results
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
