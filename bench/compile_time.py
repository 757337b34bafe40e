"""Compile time of a 7.5B GPT and of the 70B dp 128 × tp 8 example: whole `zerocc` commands.

The 7.5B model is the example GPT on the meta device (36 layers, 4096 wide, sequence 2048,
vocabulary 32000), ZeRO-3 with Block units, bf16; the 70B one is examples/gpt/70b-tp.yaml
(80 layers, 8192 wide, tensor and sequence parallel) on 1024 ranks. Nothing is allocated, so
each command is capture, the pass list and the report. Each command runs as its own
process, ``--repeat`` times; the table gives the minimum and median CPU time (user + system of
the process, what the machine's load does not inflate much) and wall time, and the JSON, with
the commit measured (:mod:`provenance`), goes to bench/results/.

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

from provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt"
PLAN = """\
workload: "workload:workload"
workload_args: {n_layer: 36, n_embd: 4096, n_head: 32, block_size: 2048, batch_size: 1,
                vocab_size: 32000, device: meta}
zero: {stage: 3}
units: {classes: [Block]}
precision: {param: bf16}
"""
TP_70B = GPT / "70b-tp.yaml"
COMMANDS = {  # name: (plan, arguments); None: the 7.5B plan above
    "7.5B inspect": (None, ["inspect"]),
    "7.5B estimate --world-size 64": (None, ["estimate", "--world-size", "64"]),
    "70B tp estimate --world-size 1024": (TP_70B, ["estimate", "--world-size", "1024"]),
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_command(args: list[str], plan: Path, repeat: int) -> dict[str, list[float]]:
    """CPU and wall seconds of ``python -m zerocc <args[0]> PLAN <args[1:]>``, one process per
    run."""
    env = {**os.environ, "PYTHONPATH": str(GPT)}
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
    measured = provenance()
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "gpt-7.5b.yaml"
        plan.write_text(PLAN)
        results = {
            name: time_command(cmd, path or plan, args.repeat)
            for name, (path, cmd) in COMMANDS.items()
        }
    print(
        f"commit {measured['commit']}, torch {measured['torch']}, Python {measured['python']}, "
        f"{measured['cores']} cores, load {measured['load_average']:.2f} before"
    )
    header = f"{'command':<36}{'CPU s min':>10}{'median':>8}{'wall s min':>11}{'median':>8}"
    print(header, "-" * len(header), sep="\n")
    for name, r in results.items():
        print(
            f"{name:<36}{min(r['cpu_s']):>10.2f}{statistics.median(r['cpu_s']):>8.2f}"
            f"{min(r['wall_s']):>11.2f}{statistics.median(r['wall_s']):>8.2f}"
        )
    ratio = min(results["70B tp estimate --world-size 1024"]["cpu_s"]) / min(
        results["7.5B estimate --world-size 64"]["cpu_s"]
    )
    print(f"70B tp estimate / 7.5B estimate (CPU, minima): {ratio:.2f}x")
    out = ROOT / "bench" / "results" / f"compile-time-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = {**measured, "plan": PLAN, "repeat": args.repeat, "results": results}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
