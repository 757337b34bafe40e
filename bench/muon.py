"""Muon against AdamW under zerocc: the step time and bytes per step of the same plan (the
example GPT at ZeRO-3 by default) on N gloo ranks, one optimizer after the other.

Run: python bench/muon.py [--plan examples/gpt/zero3.yaml] [--nproc 2] [--steps 20]
Prints a table and writes bench/results/muon-<time>.json. Not a test (issue 81's target:
Muon's step within 1.15x of AdamW's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = {"adamw": ["--set", "optimizer.name=adamw"],
              "muon": ["--set", "optimizer.name=muon", "--set", "optimizer.lr=0.02"]}  # fmt: skip


def run(plan: Path, nproc: int, steps: int, flags: list[str]) -> dict:
    """One `zerocc train` run: its steps per second after the first, final loss and bytes."""
    command = [sys.executable, "-m", "zerocc", "train", str(plan), "--nproc", str(nproc),
               "--steps", str(steps), *flags]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    out = done.stdout + done.stderr
    rate = float(re.search(r"([0-9.]+) steps/s after it", out).group(1))
    return {
        "steps_per_s": rate,
        "step_ms": 1000 / rate,
        "final_loss": float(re.search(r"final loss: (\S+)", out).group(1)),
        "communication": re.search(r"communication per step: (.*)", out).group(1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=ROOT / "examples" / "gpt" / "zero3.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    results = {name: run(args.plan, args.nproc, args.steps, f) for name, f in OPTIMIZERS.items()}
    ratio = results["muon"]["step_ms"] / results["adamw"]["step_ms"]
    print(f"{'optimizer':10} {'step ms':>8} {'loss':>7}  communication per step")
    for name, r in results.items():
        print(f"{name:10} {r['step_ms']:8.1f} {r['final_loss']:7.4f}  {r['communication']}")
    print(f"muon / adamw step time: {ratio:.2f}x ({args.nproc} ranks, {args.steps} steps)")
    report = {"plan": str(args.plan), "nproc": args.nproc, "steps": args.steps,
              "results": results, "muon_over_adamw": ratio}  # fmt: skip
    out = ROOT / "bench" / "results" / f"muon-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
