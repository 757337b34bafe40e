"""What each memory-saving option costs in step time, and what it saves: zerocc stage 3 with its
optimizer, its parameters or both offloaded (host memory or NVMe files) and with activation
recomputation, next to FSDP2's ``CPUOffloadPolicy`` and DeepSpeed ZeRO-3's offload, on the same
model, seed, batches, optimizer and ranks.

The systems run as in bench/compare.py (whose code runs them): each on its own fresh ranks, set
up one at a time (capture, warm-up untimed), then timed in interleaved rounds. Reported per
system: the median step time and its IQR, the CPU time of a step (the work, which other jobs
on the machine stretch far less than the time), their ratios to the family's baseline without
offload (zerocc-z3, fsdp2-z3, deepspeed-z3) and to zerocc-z3's, the peak RSS Δ, and for zerocc
the model-state bytes in each pool (device, host, NVMe files), the bytes offload copies per
step, its predicted step time over the measured one, and whether its losses equal zerocc-z3's
step by step on every rank: they must, since neither offload nor recomputation changes any
arithmetic (but offload.defer_updates: delayed, whose gradients are a step stale by design: its loss
is shown, not held). The peers' losses are held against
zerocc-z3's within a tolerance, as in compare.py. A system that fails is reported with its
error; one that needs a GPU is marked "not runnable on CPU". Usage::

    python bench/offload.py                    # GPT 6 × 384 (10.7M), 2 CPU ranks, 17 systems
    python bench/offload.py --systems zerocc   # families or system names (+ their baselines)
    python bench/offload.py --tiny             # a 1-layer GPT, one timed step: a smoke test
    python bench/offload.py --gpu --systems zerocc   # one GPU: a 1.3B GPT, bf16
    python bench/offload.py --gpu --sequential ...   # one system at a time (its memory)

Prints the table last; writes ``bench/results/offload-<device>-<date>.json``. Exits 1 when a
zerocc variant fails or its losses differ from zerocc-z3's, or a peer's final loss is outside
the tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from compare import SEQUENTIAL, compare_losses, machine, run_systems, select, summarize
from config import BenchConfig, add_config_arguments, config_from, num_params
from report import MIB, write_json
from systems import OWN_NUMERICS, ZEROCC_SAVINGS, System, all_systems, offload_systems

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE = "zerocc-z3"
BASELINES = {"zerocc": "zerocc-z3", "fsdp2": "fsdp2-z3", "deepspeed": "deepspeed-z3"}
# Smaller than compare.py's 10 × 512 (same rounds) so that 17 systems run in ~7 minutes on 2
# idle cores (~8 while other jobs run).
DEFAULT = dict(n_layer=6, n_embd=384, n_head=6, warmup=2, rounds=5, steps=3)
TINY = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=2, warmup=1, rounds=1,
            steps=1)  # fmt: skip
# --gpu: issue 22's run, a 1.3B GPT (24 × 2048) on one GPU, bf16, 4 sequences of 1024 tokens.
GPU = dict(n_layer=24, n_embd=2048, n_head=16, block_size=1024, vocab_size=50304, batch_size=4,
           world_size=1, device="cuda", dtype="bf16", warmup=2, rounds=3, steps=2)  # fmt: skip
RECOMPUTING = {f"zerocc-z3-{suffix}" for suffix, _, ckpt, _ in ZEROCC_SAVINGS if ckpt}
# What an error says when the system needs an accelerator the machine does not have.
NEEDS_GPU = re.compile(r"accelerator|CUDA|cuda|pin_memory|pinned")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help=f"a smoke test: {TINY}")
    p.add_argument("--gpu", action="store_true", help="one GPU, bf16, a 1.3B GPT")
    p.add_argument(
        "--systems",
        nargs="+",
        default=["all"],
        help="system names or families (zerocc, fsdp2, deepspeed); default: all",
    )
    add_config_arguments(p)
    p.add_argument("--nvme-dir", type=Path, help="where the NVMe files go (default: temp folder)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace, nvme_path: str) -> BenchConfig:
    preset = TINY if args.tiny else GPU if args.gpu else DEFAULT
    base = replace(BenchConfig(), **preset, nvme_path=nvme_path)
    return config_from(args, base)


def candidates() -> dict[str, System]:
    """Each family's stage-3 baseline, then its memory-saving variants."""
    every = all_systems()
    variants = offload_systems()
    out: dict[str, System] = {}
    for family, baseline in BASELINES.items():
        out[baseline] = every[baseline]
        out.update((n, s) for n, s in variants.items() if s.family == family)
    return out


def recompute_missing() -> str | None:
    """Why zerocc's recompute pass cannot run here, or None when it imports."""
    try:
        import zerocc.compiler.passes.recompute  # noqa: F401
    except Exception as e:  # being written by another change: any failure leaves it out
        return f"{type(e).__name__}: {e}"
    return None


def chosen(wanted: list[str], systems: dict[str, System]) -> list[str]:
    """The systems asked for, with their families' baselines and zerocc-z3, in table order."""
    names = set(select(wanted, systems))
    names |= {BASELINES[systems[n].family] for n in names} | {REFERENCE}
    return [n for n in systems if n in names]


def rank_losses(run: dict[str, Any]) -> list[list[float]]:
    """Every step's loss, one list per rank."""
    ranks = len(run["answers"][0])
    return [[x for a in run["answers"] for x in a[r]["losses"]] for r in range(ranks)]


def finish_rows(rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> None:
    """Add CPU time, ratios to the baselines, zerocc's pools and copies, the loss identity."""
    for r in rows:
        if r["status"] != "ok":
            if NEEDS_GPU.search(r["error"].split("\n", 1)[0]):
                r["status"] = "not runnable on CPU"
            continue
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    for r in ok.values():
        base, ref = ok.get(BASELINES[r["family"]]), ok.get(REFERENCE)
        for key, of in (("median_step_s", ""), ("median_cpu_step_s", "_cpu")):
            r[f"x_own_baseline{of}"] = r[key] / base[key] if base else None
            r[f"x_zerocc{of}"] = r[key] / ref[key] if ref else None
        if r["family"] != "zerocc":
            continue
        reported = [a["reported"] for a in runs[r["name"]]["answers"][-1]]
        by_pool = [x["state_bytes_by_location"] for x in reported]  # the step's, by rank
        r["state_bytes"] = {p: max(x[p]["total"] for x in by_pool) for p in by_pool[0]}
        r["state_bytes_by_rank"] = by_pool
        kinds = {k for x in reported for k in x["transfer_bytes"]}
        r["copy_bytes"] = {k: max(x["transfer_bytes"].get(k, 0) for x in reported) for k in kinds}
        r["copy_bytes_as_compiled"] = reported[0]["transfer_bytes_program"]
        r["predicted_step_s"] = max(x["predicted_step_s"] for x in reported)
        r["predicted_rates"] = reported[0]["predicted_rates"]
        if all("predicted_step_s_host_rates" in x for x in reported):
            r["predicted_step_s_host_rates"] = max(
                x["predicted_step_s_host_rates"] for x in reported
            )
            r["host_rates"] = reported[0]["host_rates"]
        r["losses_identical"] = (
            rank_losses(runs[r["name"]]) == rank_losses(runs[REFERENCE])
            if ref and r["name"] not in OWN_NUMERICS
            else None
        )


def table(rows: list[dict[str, Any]]) -> str:
    """One row per system: time and its ratios, memory, zerocc's pools, the losses."""
    header = (
        f"{'system':<29}{'step ms':>8}{'IQR':>5}{'× own':>6}{'× zcc':>6}{'CPU ms':>8}{'× own':>6}"
        f"{'RSS Δ MiB':>10}{'live MiB':>9}{'alloc MiB':>10}"
        f"{'dev MiB':>8}{'host MiB':>9}{'nvme MiB':>9}{'copy MiB':>9}{'pred ×':>7}"
        f"  losses vs {REFERENCE}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['name']:<29}{r['status'].upper()}: {r['error'].splitlines()[0]}")
            continue
        state, copied = r.get("state_bytes"), r.get("copy_bytes")
        pools = [_mib(state and state[p]) for p in ("device", "host", "nvme")]
        copy = None if copied is None else sum(copied.values())
        predicted = None
        if r["family"] == "zerocc":
            same = r["losses_identical"]
            verdict = "-" if same is None else "identical" if same else "DIFFER"
            if r["name"] in OWN_NUMERICS:
                verdict = f"own numerics by design: rel Δ {r['loss_rel_diff']:.1e}"
            predicted = r.get("predicted_step_s_host_rates", r["predicted_step_s"])
            predicted /= r["median_step_s"]
        else:
            verdict = f"rel Δ {r['loss_rel_diff']:.1e}"
        lines.append(
            f"{r['name']:<29}{1e3 * r['median_step_s']:>8.0f}{1e3 * r['iqr_step_s']:>5.0f}"
            f"{_ratio(r['x_own_baseline']):>6}{_ratio(r['x_zerocc']):>6}"
            f"{1e3 * r['median_cpu_step_s']:>8.0f}{_ratio(r['x_own_baseline_cpu']):>6}"
            f"{_mib(r['peak_memory']):>10}{_mib(r['live_tensor_peak']):>9}"
            f"{_mib(r['allocated_peak']):>10}"
            f"{pools[0]:>8}{pools[1]:>9}{pools[2]:>9}{_mib(copy):>9}{_ratio(predicted):>7}"
            f"  {verdict}"
        )
    return "\n".join(lines)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def legend(rows: list[dict[str, Any]]) -> str:
    lines = [
        "step ms: median of the timed steps (a step lasts as long as its slowest rank); IQR: the",
        "  spread of their middle half. × own: step time over the family's baseline without",
        f"  offload (zerocc-z3, fsdp2-z3, deepspeed-z3); × zcc: over {REFERENCE}'s.",
        "CPU ms: CPU time (user + system, all threads) of a rank per step, the busier rank's,",
        "  median over the rounds; × own: over the family baseline's. Other load on the machine",
        "  stretches the step times, much less this.",
        "RSS Δ: peak resident memory over the timed steps minus that once the library was",
        "  imported and the model built, max over ranks; on a CPU it holds every pool alike.",
        "live: zerocc's peak bytes of live tensors in one step (step.profile): the device pool's",
        "  model states and every transient tensor. alloc: the most tensor bytes one step holds",
        "  beyond what was live before it, from the allocator, every system alike (compare.py's",
        "  step alloc).",
        "dev / host / nvme: zerocc's model states (params, grads, masters, optimizer states) of",
        "  one rank in each pool; copy: bytes offload copied in the last step (to and from the",
        "  host and the NVMe files), max over ranks.",
        "pred ×: zerocc estimate's predicted step (the compiled programs simulated with the",
        "  plan's rates: a calibration, else the device's defaults) over the measured one; on a",
        "  GPU with the optimizer offloaded, the host's update and link rates measured in the run",
        "  (as `zerocc profile` measures them; the JSON keeps the defaults' prediction too).",
        f"losses: zerocc's must equal {REFERENCE}'s at every step on every rank (but a delayed",
        "  update's, which computes on weights a step old); the peers' final loss relative to",
        f"  {REFERENCE}'s.",
        "Systems:",
    ]
    width = max(len(r["name"]) for r in rows) + 2
    return "\n".join(lines + [f"  {r['name']:<{width}}{r['what']}" for r in rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = candidates()
    names = chosen(args.systems, systems)
    left_out: dict[str, str] = {}
    if why := recompute_missing():
        left_out = {
            n: f"zerocc.compiler.passes.recompute does not import: {why}" for n in RECOMPUTING
        }
        names = [n for n in names if n not in left_out]
    with tempfile.TemporaryDirectory(prefix="zerocc-bench-nvme-", dir=args.nvme_dir) as nvme:
        cfg = make_config(args, nvme)
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # before any rank starts
        info = machine(cfg)
        load = [os.getloadavg()[0]]  # other work on the machine is noise in the step times
        print(f"{len(names)} systems, GPT {num_params(cfg) / 1e6:.1f}M parameters, "
              f"{cfg.world_size} rank(s) on {cfg.device} × {cfg.threads} thread(s), "
              f"{cfg.total_steps} steps each; NVMe files under {nvme}", flush=True)  # fmt: skip
        runs = run_systems(cfg, names, args.timeout)
        info["load_1min_before_after"] = [*load, os.getloadavg()[0]]
    rows = [summarize(cfg, systems[n], runs[n], None) for n in names]
    compare_losses(rows, cfg.dtype)
    finish_rows(rows, runs)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"offload-{cfg.device}-{stamp}.json"
    write_json(path, {
        "machine": info, "config": asdict(cfg), "params": num_params(cfg),
        "reference": REFERENCE, "baselines": BASELINES, "left_out": left_out,
        "systems": rows,
    })  # fmt: skip
    before, after = info["load_1min_before_after"]  # after: with the last system's ranks
    title = (f"GPT {num_params(cfg) / 1e6:.1f}M ({cfg.n_layer} × {cfg.n_embd}), "
             f"{cfg.world_size} rank(s) × {cfg.threads} thread(s), {cfg.device}, {cfg.dtype}, "
             f"{info['date']}; median of {cfg.rounds} rounds × {cfg.steps} timed steps "
             f"(after {cfg.warmup} warm-up steps{SEQUENTIAL if cfg.sequential else ''}); "
             f"load average {before:.1f} before the run, "
             f"{after:.1f} at its end")  # fmt: skip
    print(f"\nwrote {path}\n\n{legend(rows)}\n")
    for name, why in left_out.items():
        print(f"left out: {name} ({why})")
    for r in rows:  # zerocc's measured copies against what its compiled program records
        if r.get("copy_bytes") not in (None, r.get("copy_bytes_as_compiled")):
            print(f"note: {r['name']} copied {r['copy_bytes']} in its last step; its program "
                  f"records {r['copy_bytes_as_compiled']}")  # fmt: skip
    print(f"\n{title}\n{table(rows)}")
    bad = [r["name"] for r in rows if r["family"] == "zerocc" and r["status"] != "ok"]
    bad += [r["name"] for r in rows if r.get("losses_identical") is False]
    bad += [
        r["name"]
        for r in rows
        if r["status"] == "ok" and r["loss_rel_diff"] > r["rtol"] and r["name"] not in OWN_NUMERICS
    ]
    if bad:
        print(f"\nFAILED or losses differ: {', '.join(dict.fromkeys(bad))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
