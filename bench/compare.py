"""zerocc against its peers, side by side in one run: the same model, seed, batches, optimizer
and world size under zerocc (ZeRO 1-3), PyTorch FSDP2 (ZeRO-3/ZeRO-2, eager and compiled),
DeepSpeed (ZeRO 1-3) and unsharded torch (eager and compiled: the speed to match at world size 1).

Each system runs on its own fresh rank processes (bench/ranks.py). They are set up one after
another (capture, torch.compile and the warm-up steps are not timed), then timed in rounds:
every system runs ``--steps`` steps per round, in turn (A B C A B C ...), so drift of the machine
falls on all alike. Reported per system: the median step time, peak memory per rank, bytes
communicated per step (counted at torch.distributed, next to the ZeRO formula) and the loss
after all steps, which must agree across systems (differences printed). A system that fails is
reported with its error. Usage::

    python bench/compare.py                    # the example GPT at 31.6M, 2 CPU ranks (~10 min)
    python bench/compare.py --quick            # a small GPT, fewer steps (~1-2 min)
    python bench/compare.py --systems zerocc fsdp2-z3   # families or system names
    python bench/compare.py --gpu              # one GPU, bf16, NCCL, a 354M GPT: tokens/s, MFU

Prints the table last; writes ``bench/results/compare-<device>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from config import (
    GPU,
    BenchConfig,
    add_config_arguments,
    config_from,
    flops_per_token,
    model_name,
    num_params,
)
from measure import zero_formula_bytes
from provenance import cpu_name, source_commit
from ranks import SystemFailed, SystemRanks
from report import legend, loss_report, plot, table, targets, write_json
from systems import System, all_systems, expert_systems, float8_systems

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE = "zerocc-z3"
RTOL = {"fp32": 1e-5, "bf16": 1e-2}  # loss after all steps, relative to the reference's
# A system Inductor compiles (zerocc's Inductor backends, torch.compile'd peers) fuses ops and
# reorders reductions: a few ulps an op, which training's steps grow. 68 steps of the 0.8M GPT
# (4 × 128, fp32): 1.25e-5 for zerocc's two Inductor forms and torch.compile'd FSDP2 alike
# (2.1e-5 at most over the steps), the three within 1e-7 of each other (2026-11-27); a wrong
# kernel moves the loss by 1e-2 or more. bf16's own rounding is larger than Inductor's.
COMPILED_RTOL = {"fp32": 1e-4, "bf16": 1e-2}
# A mixture of experts routes each token to its top-2 experts, a choice a last-bit difference
# can flip; from the first flip on, losses part. 22 steps of the 13.7M Mixtral (4 × 256, fp32,
# eager experts): zerocc against torch within 4e-8 for 7 steps, then 1.6e-5 growing to 4.5e-3,
# FSDP2 and torch identical (2026-11-28). Any system, any dtype.
MOE_RTOL = 1e-2
# float8 matmuls round each operand to 3 mantissa bits (e4m3) against bf16's 7: their losses
# are their own. 300 steps of the example GPT (bench/quantized.py --float8, BENCHMARKS.md):
# every fp8 curve within 0.008 of its bf16 twin's, ~0.5% of the loss; held to 3e-2 here.
FLOAT8_RTOL = 3e-2
QUICK = dict(n_layer=2, n_embd=128, n_head=4, warmup=2, rounds=2, steps=2)
SEQUENTIAL = "; systems one after another"  # a title's note for --sequential
PEAK_TFLOPS = {"H100": 989.5, "H200": 989.5, "A100": 312.0, "L40S": 362.0}  # bf16 dense


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"small and short: {QUICK}")
    p.add_argument("--gpu", action="store_true", help="one GPU, bf16, NCCL, a 354M GPT")
    p.add_argument(
        "--systems",
        nargs="+",
        default=["all"],
        help="system names or families (zerocc, fsdp2, deepspeed, torch); default all",
    )
    add_config_arguments(p)
    p.add_argument("--vocab", type=int, dest="vocab_size")
    p.add_argument("--world-size", type=int, dest="world_size")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="compute dtype (fp32 masters)")
    p.add_argument("--rtol", type=float, help="loss parity tolerance, relative, for every system "
                   f"(default {RTOL}, {COMPILED_RTOL} for a compiled one, {MOE_RTOL} for "
                   "--model mixtral)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s of one device, for MFU")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace) -> BenchConfig:
    base = replace(BenchConfig(), **((GPU if args.gpu else {}) | (QUICK if args.quick else {})))
    return config_from(args, base)


def select(wanted: list[str], systems: dict[str, System]) -> list[str]:
    """Names in ``wanted`` (or all of a family) in the canonical order, then the named systems
    no family holds (``zerocc-z3-ep``, ``torch-compiled-fp8-rowwise``: bench/systems.py's
    ``expert_systems`` and ``float8_systems``) in the order given; unknown names fail."""
    chosen: set[str] = set()
    named: list[str] = []
    for w in wanted:
        match = [n for n, s in systems.items() if w in ("all", n, s.family)]
        if not match and w in expert_systems() | float8_systems():
            named.append(w)
        elif not match:
            raise SystemExit(f"unknown system {w!r}; known: {', '.join(systems)}")
        chosen.update(match)
    return [n for n in systems if n in chosen] + named


def run_systems(cfg: BenchConfig, names: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Set each system up, time them in interleaved rounds, collect what every rank measured.
    ``cfg.sequential``: each system set up, timed and closed before the next starts, so only
    one holds memory at a time (an idle GPU machine, where a 1.3B offloaded system pins ~20 GB
    of host memory), and a run stopped by a time limit has whole systems done."""
    runs: dict[str, dict[str, Any]] = {n: {"answers": []} for n in names}
    live: dict[str, SystemRanks] = {}

    def fail(name: str, error: Exception) -> None:
        runs[name]["error"] = str(error)
        print(f"  {name}: FAILED: {str(error).splitlines()[0]}", flush=True)
        if name in live:
            live.pop(name).close()

    for group in [[n] for n in names] if cfg.sequential else [names]:
        for name in group:  # one at a time: compilation and warm-up are not timed
            print(f"setting up {name} ...", flush=True)
            try:
                live[name] = SystemRanks(name, cfg, timeout)
                runs[name]["ready"] = live[name].ready
                runs[name]["answers"].append(live[name].command("warmup", cfg.warmup))
                runs[name]["allocated"] = live[name].command("allocated", 1)  # untimed
                setup = max(r["setup_s"] for r in live[name].ready)
                print(f"  set up in {setup:.1f} s; warm-up {_step_times(runs[name])}", flush=True)
                reported = runs[name]["answers"][-1][0].get("reported", {})
                if "setup_seconds" in reported:  # zerocc's, by phase: where a slow start went
                    # (imported here: zerocc must not be imported before the ranks' comm
                    # counters wrap torch.distributed, and the ranks import this module)
                    from zerocc.inspect.explain import setup_line

                    print(f"  {setup_line(reported['setup_seconds'])}", flush=True)
                for note in reported.get("backend_notes", []):  # rank 0's lowering
                    print(f"  {note}", flush=True)
            except SystemFailed as e:
                fail(name, e)
        for r in range(cfg.rounds):
            order = list(live) if r % 2 == 0 else list(reversed(live))  # A B C, C B A, ...
            if order:
                print(f"round {r + 1}/{cfg.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                try:  # one untimed step first: the rank gave its free memory back while idle
                    runs[name]["answers"].append(live[name].command("round", 1 + cfg.steps))
                    print(f"  {name}: {_step_times(runs[name], first_untimed=True)}", flush=True)
                except SystemFailed as e:
                    fail(name, e)
        for name in list(live):
            try:
                runs[name]["final"] = live[name].command("finish")
            except SystemFailed as e:
                fail(name, e)
            else:
                live.pop(name).close()
    return runs


def _step_times(run: dict[str, Any], first_untimed: bool = False) -> str:
    """The steps of a system's last command, each its slowest rank's time, and zerocc's
    prediction of a step (with the host's measured rates where an offloaded step has them),
    as they end: a run stopped by a time limit (a GPU session's) still says how far it got."""
    answer = run["answers"][-1]
    times = [max(ranks) * 1e3 for ranks in _by_step(answer, "times")]
    reported = answer[0].get("reported", {})
    predicted = reported.get("predicted_step_s_host_rates", reported.get("predicted_step_s"))
    said = f"; predicted {predicted * 1e3:.0f} ms" if predicted is not None else ""
    untimed = " (the first untimed)" if first_untimed else ""
    return "steps " + " ".join(f"{t:.0f}" for t in times) + " ms" + untimed + said


def summarize(cfg: BenchConfig, system: System, run: dict[str, Any],
              peak_flops: float | None) -> dict[str, Any]:  # fmt: skip
    """One system's row: medians, maxima over ranks, the loss curve (mean over ranks)."""
    out: dict[str, Any] = {"name": system.name, "family": system.family, "stage": system.stage,
                           "what": system.what, "compiled": system.compiled,
                           "float8": system.float8}  # fmt: skip
    if "error" in run:
        return out | {"status": "failed", "error": run["error"]}
    answers = run["answers"]  # [warm-up, round 1, ...], each a list by rank
    # A step lasts as long as its slowest rank; the first step of each round is not timed.
    timed = [max(ranks) for a in answers[1:] for ranks in _by_step(a, "times")[1:]]
    losses = [statistics.fmean(ranks) for a in answers for ranks in _by_step(a, "losses")]
    final, ready, last = run["final"], run["ready"], answers[-1]
    median = statistics.median(timed)
    cpu = cpu_per_step(run)
    if cfg.device == "cuda":
        memory = max(f["cuda_max_allocated"] for f in final)
    else:
        memory = max(f["peak_rss"] - f["rss_built"] for f in final)
    live = [r.get("live_tensor_peak") for r in answers[0] if r.get("live_tensor_peak")]
    allocated = [r["allocated_peak"] for r in run["allocated"]]
    gather_bytes = 2 if cfg.dtype == "bf16" else 4  # parameters travel in the compute dtype
    tokens_per_s = cfg.tokens_per_step / median
    return out | {
        "status": "ok",
        "steps": len(losses),
        "median_step_s": median,
        "iqr_step_s": _iqr(timed),
        "cpu_step_s": cpu,
        "median_cpu_step_s": statistics.median(cpu),
        "step_times_s": timed,
        "losses": losses,
        "final_loss": losses[-1],
        "peak_memory": memory,
        "peak_rss_per_rank": [f["peak_rss"] for f in final],
        "rss_built_per_rank": [f["rss_built"] for f in final],
        "peak_rss_with_setup_per_rank": [
            max(f["peak_rss"], f["peak_rss_setup"] or 0) for f in final
        ],
        "live_tensor_peak": max(live) if live else None,
        "allocated_peak": max(allocated),
        "comm_bytes": last[0]["comm"]["bytes"],
        "comm_calls": last[0]["comm"]["calls"],
        "comm_bytes_reported": last[0]["reported"].get("comm_bytes"),
        "model_state_bytes_reported": last[0]["reported"].get("model_state_bytes"),
        "comm_formula": zero_formula_bytes(
            system.stage, num_params(cfg), gather_bytes, 4, cfg.world_size
        ),
        "setup_s": max(r["setup_s"] for r in ready),
        "warmup_s": max(r["wall_s"] for r in answers[0]),
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(cfg) / (peak_flops * cfg.world_size)
        if peak_flops
        else None,
    }


def cpu_per_step(run: dict[str, Any]) -> list[float]:
    """CPU seconds per step of each round (its untimed first step included), the busier rank's:
    the work a step does, which other load on the machine inflates far less than its time."""
    answers = run["answers"]  # [warm-up, round 1, ...], each a list by rank
    # Round 1 starts after the step that measured allocations (profiled: not a round's work).
    starts = [run.get("allocated", answers[0]), *answers[1:-1]]
    return [
        max((now["reported"]["cpu_s"] - then["reported"]["cpu_s"]) / len(now["times"])
            for then, now in zip(before, after, strict=True))
        for before, after in zip(starts, answers[1:], strict=True)
    ]  # fmt: skip


def _iqr(values: list[float]) -> float:
    """Interquartile range: how far apart the middle half of ``values`` lies."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def _by_step(answer: list[dict[str, Any]], key: str) -> list[tuple[float, ...]]:
    """``answer[rank][key][step]`` regrouped as one tuple of the ranks' values per step."""
    return list(zip(*(r[key] for r in answer), strict=True))


def compare_losses(
    rows: list[dict[str, Any]], dtype: str, rtol: float | None = None, moe: bool = False
) -> str | None:
    """Fill in each row's loss difference from the reference's and the tolerance it is held to
    (``rtol``, else :data:`MOE_RTOL` for a mixture of experts, :data:`RTOL` or, compiled,
    :data:`COMPILED_RTOL` for ``dtype``); returns the reference's name."""
    ok = [r for r in rows if r["status"] == "ok"]
    ref = next((r for r in ok if r["name"] == REFERENCE), ok[0] if ok else None)
    for r in ok:
        rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True)]
        r["loss_rel_diff"], r["max_rel_diff_steps"] = rel[-1], max(rel)
        default = MOE_RTOL if moe else (COMPILED_RTOL if r["compiled"] else RTOL)[dtype]
        default = max(default, FLOAT8_RTOL) if r["float8"] else default
        r["rtol"] = rtol or default
    return ref["name"] if ref else None


def machine(cfg: BenchConfig) -> dict[str, Any]:
    import torch

    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": source_commit(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zerocc": _version("zerocc"),
        "deepspeed": _version("deepspeed"),
    }
    if cfg.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _peak_flops(args: argparse.Namespace, info: dict[str, Any]) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    gpu = info.get("gpu", "")
    return next((t * 1e12 for name, t in PEAK_TFLOPS.items() if name in gpu), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    systems = all_systems()
    names = select(args.systems, systems)
    # Every rank's libraries size their thread pools from these (set before any rank starts).
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    if cfg.device == "cpu":  # the ranks hold the cores; a GPU host's are free to compile on
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    info = machine(cfg)
    print(f"{len(names)} systems, {model_name(cfg)} parameters, "
          f"{cfg.world_size} rank(s) on {cfg.device} × {cfg.threads} thread(s), "
          f"{cfg.total_steps} steps each", flush=True)  # fmt: skip
    runs = run_systems(cfg, names, args.timeout)
    rows = [summarize(cfg, systems[n], runs[n], _peak_flops(args, info)) for n in names]
    reference = compare_losses(rows, cfg.dtype, args.rtol, moe=cfg.model == "mixtral")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out / f"compare-{cfg.device}-{stamp}"
    write_json(stem.with_suffix(".json"), {
        "machine": info, "config": asdict(cfg), "params": num_params(cfg),
        "reference": reference, "targets": targets(rows), "systems": rows,
    })  # fmt: skip
    gpu = cfg.device == "cuda"
    title = (f"{model_name(cfg)}, {cfg.world_size} rank(s), {cfg.device}, "
             f"{cfg.dtype}, {info['date']}")  # fmt: skip
    plot(stem.with_suffix(".png"), rows, title, gpu)
    print(f"\nwrote {stem}.json and {stem}.png\n")
    print(loss_report(rows, reference) + "\n")
    print(legend(rows, gpu) + "\n")
    if goals := targets(rows):
        print("\n".join(goals) + "\n")
    print(f"{title}; median of {cfg.rounds} rounds × {cfg.steps} timed steps "
          f"(after {cfg.warmup} warm-up steps and 1 measuring allocations; 1 untimed step opens "
          f"each round"
          f"{SEQUENTIAL if cfg.sequential else ''})")  # fmt: skip
    print(table(rows, reference, gpu))
    differs = [r for r in rows if r["status"] == "ok" and r["loss_rel_diff"] > r["rtol"]]
    return 1 if differs or not reference else 0


if __name__ == "__main__":
    sys.exit(main())
