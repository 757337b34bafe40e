"""What offload.defer_updates hides: an offloaded step's host update beside the compute (issue 22).

One rank, stage 3, the optimizer offloaded (``offload.optimizer: cpu``), with each
``offload.defer_updates``: ``none`` (the step ends with its host updates), ``next_forward`` (each
update runs beside the next forward, waited for at its unit's first gather: the same losses,
checked) and ``delayed`` (beside forward and backward, gradients a step stale: its losses are
shown, not held). On a GPU machine the host's worker is a thread beside the one that issues
the GPU's work; a CPU-only step runs its updates inline (the same cores compute). Here the
worker is a thread on the CPU too, and the compute and the update get one core each
(``torch.set_num_threads(1)``), so what the overlap gains on two cores is measured. The model
is small in tokens for its parameters (one sequence of 64 per step), so that the update weighs
something beside the compute: with the ``fused`` kernels (the CPU's default) it is a few ms of
the step, with the ``torch`` reference's several passes a quarter of it.

One process per kernel set (import, compile and two warm-up steps per mode untimed) builds a
step of each mode; the modes take turns, ``--steps`` timed steps each, ``--rounds`` times (the
machine's drift is shared alike). Per mode: the median step time and its IQR, CPU time per
step (both threads), their ratios to ``none``. Usage::

    python bench/deferred_updates.py     # GPT 4 × 512, fused and torch, 4 rounds × 5 steps
    python bench/deferred_updates.py --rounds 1 --steps 2 --layers 1 --kernels fused  # smoke

Prints the table last; writes ``bench/results/deferred_updates-cpu-<date>.json`` (``--out``).
Exits 1 when next_forward's losses differ from none's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GPT = Path(__file__).parent.parent / "examples" / "gpt"
MODES = ("none", "next_forward", "delayed")

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, {gpt!r})
import zerocc
from model import GPT, GPTConfig
from zerocc.runtime import step as runtime
from zerocc.engine.host_worker import HostWorker

# The worker a GPU machine gets (a thread beside the compute), on this CPU.
runtime.HostWorker = lambda threaded=False: HostWorker(threaded=True)


def build(mode):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=64, n_layer={layers}, n_head=8, n_embd={embd})
    plan = {{
        "zero": {{"stage": 3}},
        "units": {{"classes": ["Block"]}},
        "optimizer": {{"name": "adamw", "lr": 1e-3, "weight_decay": 0.1}},
        "backend": {{"kernels": {kernels!r}}},
        "offload": {{"optimizer": "cpu", "defer_updates": mode}},
    }}
    return zerocc.compile(GPT(config), plan)


steps = {{mode: build(mode) for mode in {modes!r}}}
g = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 65, (1, 64), generator=g), torch.randint(0, 65, (1, 64), generator=g))
           for _ in range({warmup} + {rounds} * {steps})]
out = {{mode: {{"losses": [], "wall": [], "cpu": []}} for mode in steps}}
for i in range({warmup}):
    for mode, step in steps.items():
        out[mode]["losses"].append(float(step(*batches[i])))
for r in range({rounds}):  # the modes take turns, a round of steps each
    for mode, step in steps.items():
        for i in range({warmup} + r * {steps}, {warmup} + (r + 1) * {steps}):
            began, began_cpu = time.perf_counter(), time.process_time()
            out[mode]["losses"].append(float(step(*batches[i])))
            out[mode]["wall"].append(time.perf_counter() - began)
            out[mode]["cpu"].append(time.process_time() - began_cpu)
print(json.dumps(out))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4, help="turns each mode takes")
    p.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode")
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["fused", "torch"],
        help="backend.kernels of the host update (one process each)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    return p.parse_args(argv)


def run_child(args: argparse.Namespace, kernels: str) -> dict:
    code = CHILD.format(gpt=str(GPT), layers=args.layers, embd=args.embd, kernels=kernels,
                        modes=MODES, warmup=args.warmup, rounds=args.rounds,
                        steps=args.steps)  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"kernels {kernels}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(kernels: str, run: dict) -> list[dict]:
    rows = []
    for mode in MODES:
        wall, cpu = run[mode]["wall"], run[mode]["cpu"]
        q1, _, q3 = statistics.quantiles(wall, n=4) if len(wall) > 1 else (wall[0],) * 3
        rows.append({
            "kernels": kernels, "mode": mode, "median_step_s": statistics.median(wall),
            "iqr_step_s": q3 - q1, "median_cpu_step_s": statistics.median(cpu),
            "losses": run[mode]["losses"],
        })  # fmt: skip
    none = rows[0]
    for r in rows:
        r["x_none"] = r["median_step_s"] / none["median_step_s"]
        r["x_none_cpu"] = r["median_cpu_step_s"] / none["median_cpu_step_s"]
        r["losses_identical"] = r["losses"] == none["losses"]
    return rows


def table(rows: list[dict]) -> str:
    header = f"{'kernels':<9}{'offload.defer_updates':<18}{'step ms':>9}{'IQR':>6}{'× none':>8}"
    header += f"{'CPU ms':>9}"
    header += f"{'× none':>8}  losses vs none"
    lines = [header, "-" * len(header)]
    for r in rows:
        verdict = "identical" if r["losses_identical"] else "differ"
        if r["mode"] == "delayed":
            verdict += " (by design: gradients a step stale)"
        lines.append(
            f"{r['kernels']:<9}{r['mode']:<18}{1e3 * r['median_step_s']:>9.1f}"
            f"{1e3 * r['iqr_step_s']:>6.1f}{r['x_none']:>8.2f}"
            f"{1e3 * r['median_cpu_step_s']:>9.1f}{r['x_none_cpu']:>8.2f}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for kernels in args.kernels for row in summarize(kernels, run_child(args, kernels))]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"deferred_updates-cpu-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    path.write_text(json.dumps({"config": config, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}\n")
    print(f"GPT ({args.layers} × {args.embd}), 1 rank, stage 3, optimizer offloaded, compute "
          f"and update on one thread each; median of {args.rounds} rounds × {args.steps} steps, "
          "the modes taking turns in one process")  # fmt: skip
    print(table(rows))
    bad = [r for r in rows if r["mode"] == "next_forward" and not r["losses_identical"]]
    if bad:
        print("\nFAILED: next_forward's losses differ from none's")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
