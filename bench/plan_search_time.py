"""The time `zerocc plan auto` takes on a 70B-class model for 1024 ranks, and what its shallow
copies cost in accuracy (issue 52: ≤ 60 s on this machine).

The plan is examples/gpt/70b-tp.yaml (LLaMA-70B sizes, 80 blocks, on the meta device) without
its ZeRO stage and its mesh: stage, recomputation, tensor parallelism and hybrid sharding are
searched for 1024 ranks, 8 a machine, 80 GiB each, on cuda rates. Each way runs as its own
process (a fresh interpreter, as `zerocc plan auto` is), ``--repeat`` times:

- ``whole``: every candidate it compiles, compiled at the model's depth (``whole=True``);
- ``line``: the default, each candidate drawn from compiles of the model cut to 4 and 6 blocks
  (:mod:`zerocc.inspect.plan_depth`), the pick compiled whole.

Reported: wall and CPU seconds of the search (minimum and median), the whole process's wall
seconds (imports and the workload too: what `zerocc plan auto` takes), candidates compiled, the
pick and its predicted step and peak, and for every candidate both ways predicted, the error
of the line against the whole compile (peak and step). Writes
``bench/results/plan-search-time-<date>.json`` with the commit measured.

    python bench/plan_search_time.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
PLAN_70B = ROOT / "examples" / "gpt" / "70b-tp.yaml"
WORLD, PER_NODE, GIB = 1024, 8, 80
WAYS = ("whole", "line")


def open_plan() -> dict[str, Any]:
    """The 70B example without its stage and mesh (what the search chooses)."""
    data = yaml.safe_load(PLAN_70B.read_text())
    del data["zero"], data["parallel"]["dp"], data["parallel"]["tp"]
    del data["parallel"]["sequence_parallel"]  # (it needs tp > 1; tp is searched)
    data["workload"] = f"{PLAN_70B.parent / 'workload.py'}:workload"
    return data


def search_once(way: str) -> dict[str, Any]:
    """One search in this process: its seconds and every candidate's figures."""
    from zerocc.compiler.plan import load_plan
    from zerocc.cost.rates import rates_for
    from zerocc.inspect.plan_search import search_plans

    plan = load_plan(open_plan())
    rates = rates_for(plan, "cuda")
    started, cpu = time.perf_counter(), time.process_time()
    search = search_plans(plan, WORLD, GIB * 2**30, rates, ranks_per_node=PER_NODE,
                          whole=way == "whole")  # fmt: skip
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    best = search.best
    return {
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "compiled": sum(c.pruned is None and c.error is None for c in search.candidates),
        "candidates": len(search.candidates),
        "pick": best.describe() if best else None,
        "pick_step_s": best.step_s if best else None,
        "pick_peak": best.peak if best else None,
        "pick_extrapolated": best.extrapolated if best else None,
        "figures": {
            c.describe(): {"peak": c.peak, "step_s": c.step_s, "extrapolated": c.extrapolated}
            for c in search.candidates if c.predicted
        },
    }


def run(way: str) -> dict[str, Any]:
    """:func:`search_once` in a fresh interpreter."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--child", way], check=True, capture_output=True, text=True
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - started  # (imports, workload, search)
    return result


def errors(whole: dict[str, Any], line: dict[str, Any]) -> dict[str, float]:
    """The largest relative error of the line's peak and step against the whole compile, over
    the candidates both predicted (the line's own, not those it compiled whole)."""
    peak, step = [], []
    for name, fig in line["figures"].items():
        other = whole["figures"].get(name)
        if fig["extrapolated"] and other is not None:
            peak.append(abs(fig["peak"] / other["peak"] - 1))
            step.append(abs(fig["step_s"] / other["step_s"] - 1))
    return {"compared": len(peak), "peak": max(peak, default=0.0), "step": max(step, default=0.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(search_once(args.child)))
        return 0
    measured = provenance()
    runs = {way: [run(way) for _ in range(args.repeat)] for way in WAYS}
    print(f"commit {measured['commit']}, torch {measured['torch']}, {measured['cores']} cores, "
          f"load {measured['load_average']:.2f} before")  # fmt: skip
    header = (f"{'search':<8}{'wall s min':>11}{'median':>8}{'CPU s min':>10}"
              f"{'process s':>10}{'compiled':>9}  pick (predicted step, peak)")  # fmt: skip
    print(header, "-" * len(header), sep="\n")
    for way, results in runs.items():
        walls = [r["wall_s"] for r in results]
        first = results[0]
        print(f"{way:<8}{min(walls):>11.1f}{statistics.median(walls):>8.1f}"
              f"{min(r['cpu_s'] for r in results):>10.1f}"
              f"{min(r['process_wall_s'] for r in results):>10.1f}{first['compiled']:>9}  "
              f"{first['pick']} ({first['pick_step_s']:.3f} s, "
              f"{first['pick_peak'] / 2**30:.2f} GiB)")  # fmt: skip
    err = errors(runs["whole"][0], runs["line"][0])
    print(f"line against whole, {err['compared']} candidates: peak within "
          f"{err['peak']:.2%}, step within {err['step']:.2%}")  # fmt: skip
    out = ROOT / "bench" / "results" / f"plan-search-time-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = {**measured, "plan": open_plan(), "world_size": WORLD, "ranks_per_node": PER_NODE,
              "memory_gib": GIB, "runs": runs, "line_errors": err}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
