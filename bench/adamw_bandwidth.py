"""Bandwidth of zerocc's fused AdamW kernel, against the GPU's copy bandwidth and torch.

An optimizer step is memory-bound, so each variant is scored by the bytes the update must move
divided by its time: for an fp32 shard of n elements with an fp32 grad and a bf16 compute copy,
n × (16 read: param, grad, exp_avg, exp_avg_sq + 14 written: the three fp32 and the copy).
Variants (same bytes, so the GB/s compare as speed):

- copy:      ``dst.copy_(src)`` on fp32, 8n bytes: what the memory system gives a plain stream.
- triton:    ``triton_kernels.adamw_`` with a bf16 ``param_copy``: one kernel.
- torch:     ``torch.optim.AdamW(fused=True).step()`` on one parameter of n elements, then
             the cast of ``param`` into a bf16 buffer: the same work from torch's best kernel.
- reference: ``reference.adamw_`` with the copy: the plain torch ops zerocc falls back to.

Each is timed with CUDA events around every call after a warm-up; the median is reported.
Needs a CUDA GPU. Usage::

    python bench/kernels.py                  # n = 2^24 .. 2^28
    python bench/kernels.py --sizes 24 26 --reps 50

Prints a table and writes ``bench/results/kernels-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from zerocc.backends.kernels import reference, triton_kernels
from zerocc.engine.kernel_set import AdamWHyper

DEVICE = "cuda"
RESULTS = Path(__file__).parent / "results"
ADAMW_BYTES_PER_ELEMENT = 4 * 4 + 3 * 4 + 2  # reads p, g, m, v; writes p, m, v and a bf16 copy
COPY_BYTES_PER_ELEMENT = 2 * 4
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def median_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median time of ``fn`` in milliseconds, each call between its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _adamw_tensors(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(DEVICE).manual_seed(0)
    return {
        "param": torch.randn(n, device=DEVICE, generator=gen),
        "grad": torch.randn(n, device=DEVICE, generator=gen),
        "exp_avg": torch.randn(n, device=DEVICE, generator=gen) * 0.1,
        "exp_avg_sq": torch.randn(n, device=DEVICE, generator=gen).abs() * 0.01,
    }


def time_copy(n: int, reps: int, warmup: int) -> float:
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), reps, warmup)


def time_zerocc(kernels, n: int, reps: int, warmup: int) -> float:
    """``kernels.adamw_`` (a zerocc kernel set) on one shard, with a bf16 compute copy."""
    state = _adamw_tensors(n)
    copy = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    step = torch.tensor(10)  # on the CPU, as zerocc keeps it

    def update() -> None:
        kernels.adamw_(
            **state,
            step=step,
            grad_coef=None,
            found_inf=None,
            param_copy=copy,
            hyper=AdamWHyper(**HYPER),
        )

    return median_ms(update, reps, warmup)


def time_torch_fused(n: int, reps: int, warmup: int) -> float:
    """torch's fused AdamW step, then the cast that makes the bf16 compute copy."""
    state = _adamw_tensors(n)
    param = torch.nn.Parameter(state["param"])
    param.grad = state["grad"]
    optimizer = torch.optim.AdamW(
        [param],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        fused=True,
    )
    optimizer.step()  # creates the moments; then seed them as the other variants do
    optimizer.state[param]["exp_avg"].copy_(state["exp_avg"])
    optimizer.state[param]["exp_avg_sq"].copy_(state["exp_avg_sq"])
    del state
    copy = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)

    def update() -> None:
        optimizer.step()
        copy.copy_(param.detach())

    return median_ms(update, reps, warmup)


def _gbps(bytes_moved: int, ms: float) -> float:
    return bytes_moved / (ms * 1e-3) / 1e9


def bench_size(log2_n: int, reps: int, warmup: int) -> dict[str, float | int]:
    n = 2**log2_n
    timings = {
        "copy": lambda: time_copy(n, reps, warmup),
        "triton": lambda: time_zerocc(triton_kernels, n, reps, warmup),
        "torch_fused_cast": lambda: time_torch_fused(n, reps, warmup),
        "reference": lambda: time_zerocc(reference, n, reps, warmup),
    }
    row: dict[str, float | int] = {"log2_n": log2_n, "n": n}
    for name, timing in timings.items():
        row[f"{name}_ms"] = timing()
        torch.cuda.empty_cache()  # each variant allocates its own tensors; 2^28 needs ~5 GiB
        bytes_per_element = COPY_BYTES_PER_ELEMENT if name == "copy" else ADAMW_BYTES_PER_ELEMENT
        row[f"{name}_gbps"] = _gbps(n * bytes_per_element, row[f"{name}_ms"])
    row["triton_pct_of_copy"] = 100 * row["triton_gbps"] / row["copy_gbps"]
    row["speedup_vs_torch_fused_cast"] = row["torch_fused_cast_ms"] / row["triton_ms"]
    row["speedup_vs_reference"] = row["reference_ms"] / row["triton_ms"]
    return row


def print_table(rows: list[dict[str, float | int]]) -> None:
    header = (
        f"{'n':>8} {'copy GB/s':>10} {'triton':>8} {'torch fused+cast':>17} {'reference':>10}"
        f" {'triton % copy':>14} {'vs torch':>9} {'vs ref':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{'2^' + str(r['log2_n']):>8} {r['copy_gbps']:>10.0f} {r['triton_gbps']:>8.0f}"
            f" {r['torch_fused_cast_gbps']:>17.0f} {r['reference_gbps']:>10.0f}"
            f" {r['triton_pct_of_copy']:>13.1f}% {r['speedup_vs_torch_fused_cast']:>8.2f}x"
            f" {r['speedup_vs_reference']:>6.2f}x"
        )
    print(
        f"GB/s: bytes the step must move ({ADAMW_BYTES_PER_ELEMENT} per element for AdamW,"
        f" {COPY_BYTES_PER_ELEMENT} for copy) / median time"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[24, 25, 26, 27, 28],
        help="log2 of the fp32 element counts (default: 24 25 26 27 28)",
    )
    parser.add_argument("--reps", type=int, default=20, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py measures GPU memory bandwidth and needs a CUDA GPU; none found")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("TRITON_INTERPRET=1 would time Triton's interpreter; unset it")

    now = datetime.datetime.now(datetime.UTC)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, {now:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, reps {args.reps}")
    rows = [bench_size(log2_n, args.reps, args.warmup) for log2_n in args.sizes]
    print_table(rows)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels-{now:%Y-%m-%d}.json"
    meta = {
        "gpu": gpu,
        "date": now.isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "reps": args.reps,
        "warmup": args.warmup,
        "adamw_bytes_per_element": ADAMW_BYTES_PER_ELEMENT,
        "copy_bytes_per_element": COPY_BYTES_PER_ELEMENT,
        "hyperparameters": HYPER,
    }
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
