"""How well the cost model predicts a real step: calibrate, measure, simulate, compare.

For each ZeRO stage asked for (2 and 3 by default), and each offload variant of bench/offload.py
asked for (``--offload``, on stage 3), fresh ranks train the benchmark's GPT (bench/config.py:
10 layers × 512, 2 gloo ranks with 1 thread each) under zerocc's default pass list (overlap on),
and:

1. calibrate with ``zerocc.inspect.calibrate.calibrate``, the code behind ``zerocc profile``: timed
   steps, every op timed (fitted to overhead + FLOPs + bytes), the collectives timed on the
   process group (fitted to latency + bandwidth);
2. measure: ``--steps`` more steps, timed as they run (a step lasts as long as its slowest
   rank), and one more profiled op by op for its exposed communication;
3. predict: the simulator replays the stepping program with the fitted rates.

The target is the prediction within 25% of the measured median step. Also shown: the case's
step predicted with another case's rates (how well a calibration carries to another
program). Prints a table; writes ``bench/results/predict-<device>-<date>.json``. Usage::

    python bench/predict.py                 # stages 2 and 3, ~3 minutes here
    python bench/predict.py --stages 3 --steps 10
    python bench/predict.py --stages 3 --offload opt-cpu opt-par-cpu-rc opt-nvme
    python bench/predict.py --stages 3 --backends eager inductor
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from compare import machine
from config import BenchConfig, batches, build_model, num_params
from ranks import free_port
from report import write_json
from systems import ZEROCC_SAVINGS, zerocc_runner

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.25  # |predicted / measured - 1|
# bench/offload.py's zerocc variants by suffix: (offload, recompute) sections, on stage 3.
VARIANTS = {suffix: (offload, recompute) for suffix, offload, recompute, _ in ZEROCC_SAVINGS}


@dataclass(frozen=True)
class Case:
    """What one row measures: a ZeRO stage, with an offload variant's sections or none, under
    a backend (the cost model's rates are fitted to what the backend runs: its per-op
    overhead from the backend's own code)."""

    stage: int
    variant: str | None = None
    backend: str = "eager"

    @property
    def label(self) -> str:
        backend = "" if self.backend == "eager" else f" {self.backend}"
        return f"zero-{self.stage}" + (f" {self.variant}" if self.variant else "") + backend


def _endless(cfg: BenchConfig, rank: int):
    while True:
        yield from batches(cfg, rank)


def case_rank(rank: int, cfg: BenchConfig, case: Case, port: int, steps: int, out: Any) -> None:
    """One rank of one case: calibrate, measure, and (rank 0) report through ``out``."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist

    from zerocc.cost.timeline import exposed_us
    from zerocc.inspect.calibrate import calibrate
    from zerocc.inspect.link_rates import slowest

    dist.init_process_group("gloo")
    offload, recompute = VARIANTS[case.variant] if case.variant else (None, None)
    step = zerocc_runner(build_model(cfg), cfg, torch.device("cpu"), stage=case.stage,
                         backend=case.backend, offload=offload,
                         recompute=recompute).train_step  # fmt: skip
    data = _endless(cfg, rank)
    step(*next(data))  # captures and compiles
    calibration = calibrate(step, data, steps=steps, warmup=cfg.warmup)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(step(*next(data)))
        times.append(time.perf_counter() - start)
    times = slowest(step.comm, times, step.device)
    _, recorder = step.profile(*next(data))
    if rank == 0:
        out.put({
            "case": case.label,
            "plan": step.plan,
            "measured_ms": [1e3 * t for t in times],
            "measured_exposed_ms": exposed_us(recorder.events) / 1e3,
            "calibration": {"rates": calibration.rates.as_dict(), **calibration.measured},
        })  # fmt: skip
    dist.destroy_process_group()


def program_of(plan: Any, cfg: BenchConfig) -> Any:
    """The case's stepping program, compiled again here on fake tensors (as `zerocc
    estimate` does): the same passes for the same world size builds the same program."""
    from zerocc.compiler.workload import Workload
    from zerocc.inspect.estimate import inspect_plan

    workload = Workload(build_model(cfg), batches=lambda rank, world: batches(cfg, rank))
    return inspect_plan(plan, cfg.world_size, workload).stepping.gm


def _predict(program: Any, rates: dict[str, Any], world_size: int) -> dict[str, float]:
    from zerocc.cost.rates import DeviceRates
    from zerocc.cost.simulate import predict_step

    fitted = DeviceRates(**rates)
    return predict_step({True: program}, 1, fitted, world_size).as_dict()


def run_case(cfg: BenchConfig, case: Case, steps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(case_rank, args=(cfg, case, free_port(), steps, out), nprocs=cfg.world_size)
    return out.get()


def summarize(result: dict[str, Any], other: dict[str, Any] | None, cfg: BenchConfig) -> dict[
        str, Any]:  # fmt: skip
    measured = statistics.median(result["measured_ms"])
    quartiles = statistics.quantiles(result["measured_ms"], n=4)
    program = program_of(result["plan"], cfg)
    predicted = _predict(program, result["calibration"]["rates"], cfg.world_size)
    row = {
        "case": result["case"],
        "measured_ms": measured,
        "iqr_ms": quartiles[2] - quartiles[0],
        "predicted_ms": predicted["step_ms"],
        "error": predicted["step_ms"] / measured - 1,
        "predicted_compute_ms": predicted["compute_ms"],
        "predicted_comm_ms": predicted["comm_ms"],
        "predicted_exposed_ms": predicted["exposed_comm_ms"],
        "measured_exposed_ms": result["measured_exposed_ms"],
        "calibration": result["calibration"],
        "measured_all_ms": result["measured_ms"],
        "plan": result["plan"].model_dump(mode="json"),
    }
    if other is not None:
        cross = _predict(program, other["calibration"]["rates"], cfg.world_size)
        row["predicted_with_other_ms"] = cross["step_ms"]
        row["error_with_other"] = cross["step_ms"] / measured - 1
    return row


def table(rows: list[dict[str, Any]]) -> str:
    width = max([7, *(len(r["case"]) + 2 for r in rows)])
    header = (f"{'case':<{width}}{'measured ms':>12}{'IQR':>6}{'predicted ms':>14}{'error':>8}"
              f"{'other cal.':>12}{'compute':>9}{'comm':>8}{'exposed pred/meas':>19}"
              f"{'  target'}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r in rows:
        other = r.get("error_with_other")
        met = "met" if abs(r["error"]) <= TARGET else "MISSED"
        lines.append(
            f"{r['case']:<{width}}{r['measured_ms']:>12.1f}{r['iqr_ms']:>6.0f}"
            f"{r['predicted_ms']:>14.1f}{100 * r['error']:>+7.0f}%"
            f"{'-' if other is None else f'{100 * other:+.0f}%':>12}"
            f"{r['predicted_compute_ms']:>9.0f}{r['predicted_comm_ms']:>8.0f}"
            f"{r['predicted_exposed_ms']:>10.0f} / {r['measured_exposed_ms']:<6.0f}  {met}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[0, 1, 2, 3])
    p.add_argument(
        "--offload",
        nargs="+",
        default=[],
        choices=list(VARIANTS),
        metavar="VARIANT",
        help="bench/offload.py's zerocc variants (by suffix) to run on stage 3 too",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=["eager"],
        choices=["eager", "inductor", "inductor-regions"],
        help="the backends every case runs under",
    )
    p.add_argument("--steps", type=int, default=7, help="timed steps (calibration and check)")
    p.add_argument("--layers", type=int, default=BenchConfig.n_layer)
    p.add_argument("--embd", type=int, default=BenchConfig.n_embd)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args(argv)
    cfg = replace(BenchConfig(n_layer=args.layers, n_embd=args.embd), threads=1)
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    info = machine(cfg)
    cases = [
        Case(stage, variant, backend)
        for backend in args.backends
        for stage, variant in [(s, None) for s in args.stages] + [(3, v) for v in args.offload]
    ]
    results = {c: run_case(cfg, c, args.steps) for c in cases}
    rows = []
    for c in cases:
        others = [o for o in cases if o != c]
        rows.append(summarize(results[c], results[others[0]] if others else None, cfg))
    title = (f"GPT {num_params(cfg) / 1e6:.1f}M, {cfg.world_size} gloo ranks × {cfg.threads} "
             f"thread, {info['date']}; {args.steps} timed steps per case")  # fmt: skip
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"predict-{cfg.device}-{stamp}.json"
    write_json(path, {"machine": info, "config": asdict(cfg), "target": TARGET, "cases": rows})
    print(f"\nwrote {path}\n\n{title}\n{table(rows)}")
    print(
        "other cal.: the error when the case is predicted with the first other case's calibration"
    )
    return 0 if all(abs(r["error"]) <= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
