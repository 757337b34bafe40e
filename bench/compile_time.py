"""Compile time of a 7.5B GPT and of the 70B dp 128 × tp 8 example: whole `zerocc` commands;
with ``--inductor``, the Inductor backends' first step by depth.

The 7.5B model is the example GPT on the meta device (36 layers, 4096 wide, sequence 2048,
vocabulary 32000), ZeRO-3 with Block units, bf16; the 70B one is examples/gpt/70b-tp.yaml
(80 layers, 8192 wide, tensor and sequence parallel) on 1024 ranks. Nothing is allocated, so
each command is capture, the pass list and the report. Each command runs as its own
process, ``--repeat`` times; the table gives the minimum and median CPU time (user + system of
the process, what the machine's load does not inflate much) and wall time, and the JSON, with
the commit measured (:mod:`provenance`), goes to bench/results/.

    python bench/compile_time.py [--repeat 3]

``--inductor``: the example GPT (128 wide, 4 heads, 64 tokens, batch 8; ZeRO-3, Block units,
one rank) at each of ``--layers`` under the eager backend, ``inductor-whole`` (the whole
program as one graph) and ``inductor`` (region by region, each distinct region, a repeated
layer's, compiled once), and, for comparison, the unsharded model under ``torch.compile``:
``torch-whole`` (the model compiled) and ``torch-regional`` (each Block compiled, PyTorch's
regional compilation recipe), trained by ``torch.optim.AdamW``. Each run is its own process:
the first step (capture, passes, compile, one step) with a fresh ``TORCHINDUCTOR_CACHE_DIR``
(cold), then again on that cache (warm), ``--repeat`` times; the warm runs also time
``--steps`` steps after the first (the median step's wall and CPU time, CPU: user + system of
the process and its compile workers).

    python bench/compile_time.py --inductor [--layers 2 8 24] [--steps 20] [--repeat 1]
        [--backends eager inductor-whole inductor torch-whole torch-regional]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


INDUCTOR_BACKENDS = ("eager", "inductor-whole", "inductor", "torch-whole", "torch-regional")
TORCH_COMPILED = ("torch-whole", "torch-regional")  # torch.compile of the unsharded model
INDUCTOR_PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "optimizer": {"name": "adamw", "lr": 1e-3},
}


def _cpu_now() -> float:
    """CPU seconds of this process and its finished children (Inductor's compile workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + _children_cpu()


def torch_compiled_step(model: Any, backend: str) -> Callable[..., Any]:
    """A training step of ``model`` (unsharded) under ``torch.compile``: the whole model
    (``torch-whole``) or each of its Blocks (``torch-regional``), AdamW as the plan's."""
    import torch

    if backend == "torch-whole":
        compiled = torch.compile(model)
    else:
        for block in model.transformer.h:
            block.compile()
        compiled = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=INDUCTOR_PLAN["optimizer"]["lr"])

    def step(*batch: Any) -> Any:
        loss = compiled(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def first_step(layers: int, backend: str, steps: int) -> dict:
    """In this process: the example GPT at ``layers`` compiled under ``backend``, its first
    step timed (wall and CPU), then ``steps`` more each timed; what the executable compiled."""
    from workload import workload

    import zerocc

    job = workload(n_layer=layers, n_embd=128, n_head=4, block_size=64, batch_size=8)
    batches = job.batches(0, 1)
    plan = {**INDUCTOR_PLAN, "backend": {"name": backend, "device": "cpu"}}
    wall, cpu = time.perf_counter(), _cpu_now()
    if backend in TORCH_COMPILED:
        step = torch_compiled_step(job.model, backend)
    else:
        step = zerocc.compile(job.model, plan, comm=zerocc.FakeComm(world_size=1))
    loss = float(step(*next(batches)))
    first = {"wall_s": time.perf_counter() - wall, "cpu_s": _cpu_now() - cpu}
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), _cpu_now()
        loss = float(step(*next(batches)))
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu_now() - cpu)
    executable = getattr(getattr(step, "_last_program", None), "run", None)
    return {
        "first": first,
        "step_wall_s": walls,
        "step_cpu_s": cpus,
        "loss": loss,
        "compilations": getattr(executable, "compilations", 0),
        "regions": len(getattr(executable, "reports", [])),
    }


def _child(layers: int, backend: str, steps: int, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(GPT), "TORCHINDUCTOR_CACHE_DIR": cache}
    args = ["--first-step", str(layers), backend, "--steps", str(steps)]
    done = subprocess.run(
        [sys.executable, __file__, *args], check=True, env=env, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def inductor_table(layers: list[int], backends: list[str], steps: int, repeat: int) -> dict:
    """Cold and warm first steps (and the warm runs' step times) per depth and backend."""
    results: dict = {}
    for depth in layers:
        for backend in backends:
            runs = results.setdefault(f"{depth}/{backend}", {"cold": [], "warm": []})
            for _ in range(repeat):
                with tempfile.TemporaryDirectory() as cache:
                    runs["cold"].append(_child(depth, backend, 0, cache))
                    if backend != "eager":
                        runs["warm"].append(_child(depth, backend, steps, cache))
                print(f"{depth} layers, {backend}: done", file=sys.stderr, flush=True)
    return results


def print_inductor(results: dict) -> None:
    """One row per depth and backend: first step cold and warm, a step's median wall and CPU
    time (warm runs), graphs compiled."""
    header = (
        f"{'layers/backend':<26}{'cold wall':>10}{'CPU':>8}{'warm wall':>10}{'CPU':>8}"
        f"{'step ms':>9}{'CPU ms':>8}{'graphs':>7}"
    )
    print(header, "-" * len(header), sep="\n")
    for name, runs in results.items():
        cold = min(runs["cold"], key=lambda r: r["first"]["wall_s"])
        row = f"{name:<26}{cold['first']['wall_s']:>10.1f}{cold['first']['cpu_s']:>8.1f}"
        if runs["warm"]:
            warm = min(runs["warm"], key=lambda r: r["first"]["wall_s"])
            step = statistics.median(s for r in runs["warm"] for s in r["step_wall_s"])
            cpu = statistics.median(s for r in runs["warm"] for s in r["step_cpu_s"])
            row += f"{warm['first']['wall_s']:>10.1f}{warm['first']['cpu_s']:>8.1f}"
            row += f"{step * 1e3:>9.1f}{cpu * 1e3:>8.1f}{cold['compilations']:>7}"
        print(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--inductor", action="store_true", help="the Inductor backends' table")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument(
        "--backends", nargs="+", default=list(INDUCTOR_BACKENDS), choices=INDUCTOR_BACKENDS
    )
    parser.add_argument("--steps", type=int, default=20, help="steps timed after a warm start")
    parser.add_argument("--first-step", nargs=2, metavar=("LAYERS", "BACKEND"), help="(a run)")
    args = parser.parse_args()
    if args.first_step:  # one run, in a process of its own: its JSON on the last line
        print(json.dumps(first_step(int(args.first_step[0]), args.first_step[1], args.steps)))
        return 0
    measured = provenance()
    if args.inductor:
        results = inductor_table(args.layers, args.backends, args.steps, args.repeat)
        print(
            f"commit {measured['commit']}, torch {measured['torch']}, "
            f"{measured['cores']} cores, load {measured['load_average']:.2f} before"
        )
        print_inductor(results)
        out = ROOT / "bench" / "results" / f"compile-inductor-{time.strftime('%Y%m%d-%H%M%S')}.json"
        report = {**measured, "plan": INDUCTOR_PLAN, "steps": args.steps, "results": results}
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out.relative_to(ROOT)}")
        return 0
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
