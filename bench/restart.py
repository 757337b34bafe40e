"""What a dead rank costs a run under ``zerocc train --max-restarts``: the wall time of a run
whose rank 1 is killed (SIGKILL) after ``--kill-after`` steps, against the same run never
killed, and the steps lost (those since the last checkpoint): restarted from the disk's
checkpoint, and from the in-memory one of the step it died after (``checkpoint.in_memory``).

The example GPT (examples/gpt/zero3.yaml) on ``--nproc`` gloo ranks of this machine, saving
every ``--save-every`` steps; the kill comes from tests/cli/dying_workload.py (rank 1 kills
itself reading a batch, on the first attempt only). The restart's own cost is the difference
of the two runs' wall times less the steps trained again.

With ``--nodes 2`` the ranks run as two launchers on this machine acting as two machines
(``--nnodes 2``, ``--nproc`` ranks in all), and what is lost is node 1: its rank clears the
node's memory and kills its launcher and itself (tests/cli/lost_node_workload.py); a
replacement launcher is started at once, and from memory its ranks receive their states from
node 0's copies. With ``--standalone`` the nodes meet at a `zerocc rendezvous` of its own
(``--rdzv-standalone``), and the node lost is node 0, whose launcher would otherwise keep the
store. With ``--fewer`` nobody replaces node 1 (``--nnodes 1:2``): node 0 goes on alone after
the rendezvous's last call, resharded, from disk or from the snapshots in memory written out
as a checkpoint; its rate after the loss is one rank's, so only the steps lost compare.

    python bench/restart.py                  # 2 ranks, 12 steps, killed after 7, saves every 4
    python bench/restart.py --nodes 2        # the same, node 1 of 2 lost
    python bench/restart.py --nodes 2 --rdzv-conf keep_alive_interval=2,keep_alive_max_attempt=3
    python bench/restart.py --nodes 2 --standalone   # node 0 of 2 lost, at a zerocc rendezvous
    python bench/restart.py --nodes 2 --fewer        # node 1 of 2 lost, not replaced

Prints a table and writes ``bench/results/restart-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
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
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
LOSE_THIS_NODE = "ZEROCC_TEST_LOSE_THIS_NODE"  # (tests/cli/lost_node_workload.py's)


def _command(plan: dict, folder: Path, args: argparse.Namespace, kill_at: int,
             in_memory: bool) -> list[str]:  # fmt: skip
    """The train command of ``plan`` killed at ``kill_at``, saving into a folder of its own."""
    plan = {**plan, "workload_args": {**plan["workload_args"], "kill_at": kill_at}}
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    saves = folder / f"ckpt-{kill_at}-{time.monotonic_ns()}"
    command = [
        sys.executable, "-m", "zerocc", "train", str(path),
        "--steps", str(args.steps), "--save-every", str(args.save_every), "--save", str(saves),
        "--max-restarts", "1", "--set", f"checkpoint.in_memory={str(in_memory).lower()}",
    ]  # fmt: skip
    return command


def _run(
    plan: dict, folder: Path, args: argparse.Namespace, kill_at: int, in_memory: bool = False
) -> dict:
    command = _command(plan, folder, args, kill_at, in_memory)
    started = time.perf_counter()
    done = subprocess.run([*command, "--nproc", str(args.nproc)], capture_output=True, text=True,
                          env=CPU_ONLY)  # fmt: skip
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return {"wall_s": wall, **_said(done.stdout, in_memory)}


def _run_nodes(
    plan: dict, folder: Path, args: argparse.Namespace, kill_at: int, in_memory: bool = False
) -> dict:
    """As :func:`_run` over two launchers acting as two nodes; node 1 (with ``--standalone``
    node 0) lost at ``kill_at`` and replaced at once."""
    command = _command(plan, folder, args, kill_at, in_memory)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    lost = 0 if args.standalone else 1

    def node(rank: int, lose: bool = False) -> subprocess.Popen:
        env = {**CPU_ONLY, "OMP_NUM_THREADS": "1", **({LOSE_THIS_NODE: "1"} if lose else {})}
        return subprocess.Popen(
            [*command, "--nproc", str(args.nproc // 2), "--nnodes",
             "1:2" if args.fewer else "2", "--node-rank",
             str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
             *(["--rdzv-standalone"] if args.standalone else []),
             *(["--rdzv-conf", args.rdzv_conf] if args.rdzv_conf else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip

    store = None
    if args.standalone:
        store = subprocess.Popen([sys.executable, "-m", "zerocc", "rendezvous", "--port",
                                  str(port)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        store.stdout.readline()  # (it listens)
    try:
        started = time.perf_counter()
        nodes = {rank: node(rank, lose=rank == lost and kill_at != NEVER) for rank in (0, 1)}
        if kill_at != NEVER:
            nodes[lost].communicate()
            nodes[lost] = None if args.fewer else node(lost)
        running = [p for p in nodes.values() if p is not None]
        outs = [p.communicate()[0] for p in running]
        wall = time.perf_counter() - started
    finally:
        if store is not None:
            store.terminate()
            store.wait()
    for process, out in zip(running, outs, strict=True):
        if process.returncode != 0:
            raise SystemExit(out[-3000:])
    return {"wall_s": wall, **_said("".join(outs), in_memory)}


def _said(out: str, in_memory: bool) -> dict:
    """What a run printed: its training rate, whether it restarted and the optimizer steps
    it resumed with, the seconds its saves to memory blocked training and (over machines) the
    seconds their copies took on their thread."""
    rate = re.search(r"([\d.]+) steps/s after it", out)
    resumed = re.search(r"resumed from .* \((\d+) optimizer steps applied\)", out)
    memory = re.search(r"checkpoints in memory: every step(?:, each copied to the next machine "
                       r"on a thread \(([\d.]+) s\))?, training blocked ([\d.]+) s in all", out)
    if in_memory and memory is None:
        raise SystemExit(f"no line on the saves to memory in:\n{out[-3000:]}")
    return {"steps_per_s": float(rate.group(1)), "restarted": "zerocc: restart 1" in out,
            "resumed_at": int(resumed.group(1)) if resumed else 0,  # (0: from the start)
            "in_memory_s": float(memory.group(2)) if memory else 0.0,
            "copied_s": float(memory.group(1) or 0) if memory else 0.0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-after", type=int, default=7, help="steps done when rank 1 dies")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: two launchers as two nodes, node 1 lost")  # fmt: skip
    p.add_argument("--rdzv-conf", help="with --nodes 2: zerocc train's --rdzv-conf")
    p.add_argument("--standalone", action="store_true",
                   help="with --nodes 2: meet at a `zerocc rendezvous`; node 0 lost")  # fmt: skip
    p.add_argument("--fewer", action="store_true",
                   help="with --nodes 2: nobody replaces node 1 (--nnodes 1:2)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    if (args.standalone or args.fewer) and args.nodes != 2:
        p.error("--standalone and --fewer go with --nodes 2")
    if args.standalone and args.fewer:
        p.error("--fewer loses node 1, --standalone node 0: one of them")
    plan = yaml.safe_load((ROOT / "examples" / "gpt" / "zero3.yaml").read_text())
    dying = "lost_node_workload.py" if args.nodes == 2 else "dying_workload.py"
    plan["workload"] = f"{ROOT / 'tests' / 'cli' / dying}:workload"
    run = _run_nodes if args.nodes == 2 else _run
    kinds = {  # name: (killed at, in memory)
        "never killed": (NEVER, False),
        "never killed, in memory": (NEVER, True),
        "killed, from disk": (args.kill_after, False),
        "killed, from memory": (args.kill_after, True),
    }
    runs: dict[str, list[dict]] = {name: [] for name in kinds}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeat):  # interleaved: the machine's load hits every kind alike
            for name, (kill_at, in_memory) in kinds.items():
                runs[name].append(run(plan, Path(folder), args, kill_at, in_memory))
    for name, (kill_at, _) in kinds.items():
        assert all(r["restarted"] == (kill_at != NEVER) for r in runs[name]), name
    lost = {  # the steps trained again: those after the step each run resumed with
        name: statistics.median(args.kill_after - r["resumed_at"] for r in runs[name])
        for name in ("killed, from disk", "killed, from memory")
    }
    wall = {name: statistics.median(r["wall_s"] for r in runs[name]) for name in kinds}
    step_s = 1 / statistics.median(r["steps_per_s"] for r in runs["never killed"])
    restart_s = {  # (none where the run goes on with fewer ranks, at another rate)
        name: wall[name] - wall[base] - lost[name] * step_s
        for name, base in (("killed, from disk", "never killed"),
                           ("killed, from memory", "never killed, in memory"))
        if not args.fewer
    }  # fmt: skip
    lost_what = "a rank killed"
    if args.nodes == 2:
        lost_what = ("node 0 of 2 lost, at a zerocc rendezvous" if args.standalone
                     else "node 1 of 2 lost, not replaced" if args.fewer
                     else "node 1 of 2 lost")  # fmt: skip
    print(f"\n{lost_what} after step {args.kill_after} of {args.steps}, saves every "
          f"{args.save_every}, {args.nproc} gloo ranks, median of {args.repeat}")  # fmt: skip
    print(f"{'run':<26}{'wall s':>9}{'steps lost':>12}{'restart s':>11}")
    for name in kinds:
        restart = f"{restart_s[name]:>11.2f}" if name in restart_s else f"{'-':>11}"
        extra = f"{lost[name]:>12g}{restart}" if name in lost else f"{'-':>12}{'-':>11}"
        print(f"{name:<26}{wall[name]:>9.2f}{extra}")
    memory_s = statistics.median(r["in_memory_s"] for r in runs["never killed, in memory"])
    copied_s = statistics.median(r["copied_s"] for r in runs["never killed, in memory"])
    copies = f" (their copies {copied_s:.2f} s on a thread)" if args.nodes == 2 else ""
    print(f"step {step_s * 1000:.1f} ms; the saves to memory blocked training {memory_s:.2f} s "
          f"over {args.steps} steps{copies}; restart: stop, start, rendezvous, compile, "
          "load")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"restart{'-nodes' if args.nodes == 2 else ''}-{stamp}.json"
    report = {**provenance(), **vars(args), "out": str(args.out), "runs": runs,
              "steps_lost": lost, "restart_s": restart_s, "wall_s": wall}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
