"""Compile time of a 7.5B GPT: the whole `zerocc inspect` and `zerocc estimate` commands.

The model is the example GPT on the meta device at 7.5B parameters (36 layers, 4096 wide,
sequence 2048, vocabulary 32000), ZeRO-3 with Block units: nothing is allocated, so the command
is capture, the pass pipeline and the report. Each command runs as its own process, ``--repeat``
times; the table gives the minimum and median CPU time (user + system of the process, what the
machine's load does not inflate much) and wall time, and the JSON goes to bench/results/.

    python bench/compile_time.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = """\
workload: "workload:workload"
workload_args: {n_layer: 36, n_embd: 4096, n_head: 32, block_size: 2048, batch_size: 1,
                vocab_size: 32000, device: meta}
zero: {stage: 3}
units: {classes: [Block]}
precision: {param: bf16}
"""
COMMANDS = {
    "inspect": ["inspect"],
    "estimate --world-size 64": ["estimate", "--world-size", "64"],
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_command(args: list[str], plan: Path, repeat: int) -> dict[str, list[float]]:
    """CPU and wall seconds of ``python -m zerocc <args> PLAN``, one process per run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "examples" / "gpt")}
    cpu, wall = [], []
    for _ in range(repeat):
        before, start = _children_cpu(), time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "zerocc", args[0], str(plan), *args[1:]],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        wall.append(time.perf_counter() - start)
        cpu.append(_children_cpu() - before)
    return {"cpu_s": cpu, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "gpt-7.5b.yaml"
        plan.write_text(PLAN)
        results = {name: time_command(cmd, plan, args.repeat) for name, cmd in COMMANDS.items()}
    header = f"{'command':<28}{'CPU s min':>10}{'median':>8}{'wall s min':>11}{'median':>8}"
    print(header, "-" * len(header), sep="\n")
    for name, r in results.items():
        print(
            f"{name:<28}{min(r['cpu_s']):>10.2f}{statistics.median(r['cpu_s']):>8.2f}"
            f"{min(r['wall_s']):>11.2f}{statistics.median(r['wall_s']):>8.2f}"
        )
    out = ROOT / "bench" / "results" / f"compile-time-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"plan": PLAN, "repeat": args.repeat, "results": results}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
