"""What a dead rank costs a run under ``zerocc train --max-restarts``: the wall time of a run
whose rank 1 is killed (SIGKILL) after ``--kill-after`` steps, against the same run never
killed, and the steps lost (those since the last checkpoint).

The example GPT (examples/gpt/zero3.yaml) on ``--nproc`` gloo ranks of this machine, saving
every ``--save-every`` steps; the kill comes from tests/cli/dying_workload.py (rank 1 kills
itself reading a batch, on the first attempt only). The restart's own cost is the difference
of the two runs' wall times less the steps trained again.

    python bench/restart.py                  # 2 ranks, 12 steps, killed after 7, saves every 4

Prints a table and writes ``bench/results/restart-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
NEVER = 10**9


def _run(plan: dict, folder: Path, args: argparse.Namespace, kill_at: int) -> dict:
    plan = {**plan, "workload_args": {**plan["workload_args"], "kill_at": kill_at}}
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    saves = folder / f"ckpt-{kill_at}-{time.monotonic_ns()}"
    command = [
        sys.executable, "-m", "zerocc", "train", str(path), "--nproc", str(args.nproc),
        "--steps", str(args.steps), "--save-every", str(args.save_every), "--save", str(saves),
        "--max-restarts", "1",
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    rate = re.search(r"([\d.]+) steps/s after it", done.stdout)
    restarted = "zerocc: restart 1" in done.stdout
    return {"wall_s": wall, "steps_per_s": float(rate.group(1)), "restarted": restarted}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-after", type=int, default=7, help="steps done when rank 1 dies")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    plan = yaml.safe_load((ROOT / "examples" / "gpt" / "zero3.yaml").read_text())
    plan["workload"] = f"{ROOT / 'tests' / 'cli' / 'dying_workload.py'}:workload"
    runs: dict[str, list[dict]] = {"never killed": [], "killed, restarted": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeat):  # interleaved: the machine's load hits both alike
            runs["never killed"].append(_run(plan, Path(folder), args, NEVER))
            runs["killed, restarted"].append(_run(plan, Path(folder), args, args.kill_after))
    assert all(r["restarted"] for r in runs["killed, restarted"])
    lost = args.kill_after - args.kill_after // args.save_every * args.save_every
    straight = statistics.median(r["wall_s"] for r in runs["never killed"])
    killed = statistics.median(r["wall_s"] for r in runs["killed, restarted"])
    step_s = 1 / statistics.median(r["steps_per_s"] for r in runs["never killed"])
    restart_s = killed - straight - lost * step_s
    print(f"\na rank killed after step {args.kill_after} of {args.steps}, saves every "
          f"{args.save_every}, {args.nproc} gloo ranks, median of {args.repeat}")  # fmt: skip
    print(f"{'run':<20}{'wall s':>9}")
    print(f"{'never killed':<20}{straight:>9.2f}")
    print(f"{'killed, restarted':<20}{killed:>9.2f}")
    print(f"steps lost: {lost} ({lost * step_s:.2f} s of training again); the restart itself "
          f"(stop, start, rendezvous, compile, load): {restart_s:.2f} s")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"restart-{stamp}.json"
    report = {**provenance(), **vars(args), "out": str(args.out), "runs": runs,
              "steps_lost": lost, "restart_s": restart_s}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
