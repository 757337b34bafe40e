"""The offloaded optimizer's host update against the host's memory bandwidth (issue 22).

An AdamW step on an fp32 shard of n elements, as offload runs it on the host, must read the
parameter, the gradient and both moments and write the three fp32 tensors back and the
compute-dtype (bf16) copy that goes back to the device: 16 bytes read + 14 written per
element, 30n in all. Each variant is scored by those 30n bytes over its time (so the GB/s
compare as speed) and against a plain copy's bandwidth measured in the same run:

- copy:            ``dst.copy_(src)``, fp32: what the memory system gives one stream (8n bytes).
- torch-fused:     ``torch._fused_adamw_`` (what ``torch.optim.AdamW(fused=True)`` runs: one
                   vectorized, multi-threaded loop), then the bf16 copy of the parameter.
- zerocc-fused:    the ``fused`` kernel set's ``adamw_`` (a step on the CPU under
                   ``backend.kernels: auto``): the gradient scaled by 1/ranks and the clip's
                   coefficient first (a pass of its own), then torch's fused loop, then the
                   bf16 copy: three passes.
- zerocc-one-pass: the ``one-pass`` kernel set's (the host updates of offloaded units on a GPU
                   machine): the same arithmetic compiled by Inductor into one C++ loop
                   (OpenMP over the shard), the scaling and the copy in it.
- deepspeed-cpu-adam: DeepSpeed's ``DeepSpeedCPUAdam`` on one parameter (then the bf16 copy),
                   where DeepSpeed is installed and its op builds.

Every variant runs on the process's torch threads (``--threads``, default all cores). Times are
the median of ``--reps`` calls after warm-up; CPU time per call beside them (the machine is
shared). The one-pass variant's result is compared with torch's fused kernel after one step
(largest difference of the parameter, in units of the largest update, printed). Usage::

    python bench/host_update.py                  # n = 2^20, 2^22, 2^24
    python bench/host_update.py --sizes 24 26 --reps 20 --threads 1

Prints a table and writes ``bench/results/host-update-cpu-<date>.json`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zerocc.backends.kernels import fused, one_pass
from zerocc.engine.kernel_set import AdamWHyper

RESULTS = Path(__file__).parent / "results"
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.1
RANKS, CLIP = 2, 0.7  # the gradient's 1/ranks and a clip coefficient, as offload applies them
HYPER = AdamWHyper(
    lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, grad_scale=1.0 / RANKS
)
BYTES_PER_ELEMENT = 30  # 16 read (param, grad, exp_avg, exp_avg_sq) + 14 written (3 fp32, bf16)


class Shard:
    """One rank's flat AdamW state of ``n`` elements, fp32, with a bf16 compute copy."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        self.param = torch.randn(n, generator=g)
        self.grad = torch.randn(n, generator=g)
        self.exp_avg = torch.randn(n, generator=g).abs() * 1e-2
        self.exp_avg_sq = torch.randn(n, generator=g).abs() * 1e-4
        self.copy = torch.empty(n, dtype=torch.bfloat16)
        self.step = torch.tensor(10.0)
        self.coef = torch.tensor(CLIP)


def torch_fused(s: Shard) -> None:
    torch._fused_adamw_([s.param], [s.grad], [s.exp_avg], [s.exp_avg_sq], [], [s.step],
                        lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WD, eps=EPS,
                        amsgrad=False, maximize=False)  # fmt: skip
    s.copy.copy_(s.param)


def zerocc_fused(s: Shard) -> None:
    fused.adamw_(s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.step, s.coef, None, s.copy,
                 HYPER)  # fmt: skip


def zerocc_one_pass(s: Shard) -> None:
    one_pass.adamw_(s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.step, s.coef, None, s.copy,
                    HYPER)  # fmt: skip


def deepspeed_cpu_adam() -> Callable[[Shard], None] | str:
    """DeepSpeed's CPU Adam on one parameter, or why it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its op does not build
        return f"not available: {type(exc).__name__}: {str(exc)[:80]}"

    def run(s: Shard) -> None:
        made = getattr(s, "deepspeed", None)
        if made is None:
            p = torch.nn.Parameter(s.param)
            opt = DeepSpeedCPUAdam([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                                   adamw_mode=True)  # fmt: skip
            made = s.deepspeed = (p, opt)
        p, opt = made
        p.grad = s.grad
        opt.step()
        s.copy.copy_(p.data)

    return run


def timed(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``fn`` over ``reps`` calls, after two warm-up calls."""
    fn()
    fn()
    walls, cpus = [], []
    for _ in range(reps):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def agreement(n: int) -> float:
    """Largest difference of the parameter after one zerocc-one-pass step from torch's fused
    kernel's (given the same scaled gradient), in units of the update's largest change."""
    a, b = Shard(n), Shard(n)
    before = b.param.clone()
    b.grad.mul_(CLIP / RANKS)
    zerocc_one_pass(a)
    torch_fused(b)
    return float((a.param - b.param).abs().max() / (b.param - before).abs().max())


def measure(n: int, variants: dict[str, Callable[[Shard], None] | str], reps: int) -> list[dict]:
    """One row per variant on a shard of ``n`` elements (the copy's first)."""
    shard = Shard(n)
    src, dst = torch.randn(n), torch.empty(n)
    copy_wall, copy_cpu = timed(lambda: dst.copy_(src), reps)
    copy_gbs = 8 * n / copy_wall / 1e9
    rows = [{"n": n, "variant": "copy", "ms": copy_wall * 1e3, "cpu_ms": copy_cpu * 1e3,
             "gb_s": copy_gbs, "of_copy": 1.0}]  # fmt: skip
    for name, fn in variants.items():
        if isinstance(fn, str):
            rows.append({"n": n, "variant": name, "error": fn})
            continue
        wall, cpu = timed(lambda fn=fn: fn(shard), reps)
        gbs = BYTES_PER_ELEMENT * n / wall / 1e9
        row = {"n": n, "variant": name, "ms": wall * 1e3, "cpu_ms": cpu * 1e3, "gb_s": gbs,
               "of_copy": gbs / copy_gbs}  # fmt: skip
        if name == "zerocc-one-pass":
            row["one_pass_vs_torch"] = agreement(n)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24], help="log2 of n")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants: dict[str, Callable[[Shard], None] | str] = {
        "torch-fused": torch_fused,
        "zerocc-fused": zerocc_fused,
        "zerocc-one-pass": zerocc_one_pass if one_pass.runs_on("cpu") else one_pass.problem(),
        "deepspeed-cpu-adam": deepspeed_cpu_adam(),
    }
    rows = [row for log2 in args.sizes for row in measure(2**log2, variants, args.reps)]
    print(f"\nhost update, AdamW + bf16 copy, {args.threads} thread(s), torch {torch.__version__}")
    print(f"{'n':>10} {'variant':<20} {'ms':>9} {'CPU ms':>9} {'GB/s':>7} {'of copy':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['n']:>10} {r['variant']:<20} {r['error']}")
            continue
        print(f"{r['n']:>10} {r['variant']:<20} {r['ms']:>9.2f} {r['cpu_ms']:>9.2f} "
              f"{r['gb_s']:>7.2f} {r['of_copy']:>8.2f}")  # fmt: skip
    for r in rows:
        if "one_pass_vs_torch" in r:
            print(f"zerocc-one-pass vs torch-fused, n={r['n']}: largest difference "
                  f"{r['one_pass_vs_torch']:.2e} of the largest update")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"host-update-cpu-{stamp}.json"
    report = {"threads": args.threads, "torch": torch.__version__,
              "bytes_per_element": BYTES_PER_ELEMENT, "rows": rows}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
