"""Training time blocked per checkpoint save: zerocc's synchronous ``save`` against its
background ``save_async``, beside torch.distributed.checkpoint's ``save`` and ``async_save``
(what torchtitan's async checkpointing runs) on the same state.

One process per system (so that one's staging buffers never share memory with another's):
the example GPT at ``--layers`` × ``--width`` (22 × 2048: 1.1B parameters), world size 1,
ZeRO stage 0, fp32, plain SGD (no momentum: the state is the weights, 4.4 GB, which with the
gradients and a staged copy fits a 24 GiB host), ``--between`` optimizer steps (3) of a 1 × 32
batch between saves. Per save: the wall and CPU seconds the training loop was blocked in the
save call (for a background save: the host copy, and any wait for the previous save still
writing); the first save apart (it allocates the staging buffers), then the median of the
others. Also: the
seconds a background save took to write, and the step's seconds while one was writing
against without, and the seconds per save interval (its steps and its save, all told: on
a machine whose cores training keeps busy, the write's own CPU work slows the steps that
overlap it). zerocc writes a BLAKE3 digest of every slice; DCP writes no checksum.

    python bench/checkpoint_save.py                          # 1.1B, 4 saves per system
    python bench/checkpoint_save.py --layers 2 --width 256 --saves 2   # smoke

Prints a table and writes ``bench/results/checkpoint-save-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import provenance

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("zerocc save", "zerocc save_async", "dcp save", "dcp async_save")
EXAMPLE = Path(__file__).parent.parent / "examples" / "gpt"

CHILD = r"""
import json, statistics, sys, time, warnings
sys.path.insert(0, {example!r})
import torch
import torch.distributed.checkpoint as dcp
from model import GPT, GPTConfig
import zerocc
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
args = json.loads(sys.argv[1])
config = GPTConfig(vocab_size=65, block_size=32, n_layer=args["layers"], n_head=16,
                   n_embd=args["width"])
with torch.device("meta"):
    model = GPT(config)
plan = {{"zero": {{"stage": 0}}, "units": {{"classes": ["Block"]}},
        "optimizer": {{"name": "sgd", "lr": 1e-3}}, "backend": {{"device": "cpu"}}}}
step = zerocc.compile(model, plan)
params = sum(p.numel() for p in model.parameters())
tokens = torch.randint(0, 65, (1, 33), generator=torch.Generator().manual_seed(0))

def train():
    wall, cpu = time.perf_counter(), time.process_time()
    step(tokens[:, :-1], tokens[:, 1:])
    return time.perf_counter() - wall, time.process_time() - cpu

train()  # compiles
system, folder = args["system"], args["folder"]
pending = None
saves, steps, writing = [], [], []
loop = time.perf_counter()
for i in range(args["saves"]):
    for _ in range(args["between"]):
        busy = pending is not None and not pending.done()
        took = train()
        (writing if busy else steps).append(took[0])
    wall, cpu = time.perf_counter(), time.process_time()
    if system == "zerocc save":
        step.save(folder, keep=1)
    elif system == "zerocc save_async":
        pending = step.save_async(folder, keep=1)
    elif system == "dcp save":
        dcp.save(step.state_dict(), checkpoint_id=f"{{folder}}/{{i}}")
    else:
        if pending is not None:
            pending.result()
        pending = dcp.async_save(step.state_dict(), checkpoint_id=f"{{folder}}/{{i}}")
    saves.append((time.perf_counter() - wall, time.process_time() - cpu))
    if system.startswith("dcp") and i >= 1:  # keep one, as zerocc's keep=1
        import shutil
        shutil.rmtree(f"{{folder}}/{{i - 1}}", ignore_errors=True)
interval = (time.perf_counter() - loop) / args["saves"]
written = None
if system == "zerocc save_async":
    step.wait_for_save()
    written = pending.times.written_s
elif system == "dcp async_save":
    pending.result()
nbytes = sum(t.nbytes for t in step.state_dict().values() if isinstance(t, torch.Tensor))
print(json.dumps({{"params": params, "state_bytes": nbytes, "saves": saves,
                  "step_s": statistics.median(steps) if steps else None,
                  "step_writing_s": statistics.median(writing) if writing else None,
                  "written_s": written, "interval_s": interval}}))
"""


def _run(args: dict) -> dict:
    code = CHILD.format(example=str(EXAMPLE))
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{args['system']}: {(done.stderr or done.stdout).strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--saves", type=int, default=4, help="saves per system (the first apart)")
    p.add_argument("--between", type=int, default=3, help="optimizer steps between saves")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for system in args.systems:
            shape = {"layers": args.layers, "width": args.width, "saves": args.saves,
                     "between": args.between}  # fmt: skip
            result = _run({**shape, "system": system, "folder": f"{folder}/{len(rows)}"})
            later = result["saves"][1:] or result["saves"]
            rows.append({
                "system": system, **result,
                "first_wall_s": result["saves"][0][0], "first_cpu_s": result["saves"][0][1],
                "wall_s": statistics.median(w for w, _ in later),
                "cpu_s": statistics.median(c for _, c in later),
            })  # fmt: skip
    sync = {r["system"].split()[0]: r["wall_s"] for r in rows if r["system"].endswith(" save")}
    first = rows[0]
    print(f"\nblocked per save: GPT {args.layers} x {args.width} ({first['params'] / 1e9:.2f}B "
          f"parameters, state {first['state_bytes'] / 2**30:.2f} GiB), one process, CPU; "
          f"median of saves 2-{args.saves}")  # fmt: skip
    print(f"{'system':<20}{'first s':>9}{'blocked s':>11}{'CPU s':>8}{'÷ own sync':>12}"
          f"{'written s':>11}{'step s':>8}{'step s writing':>16}{'s per save':>12}")  # fmt: skip
    for r in rows:
        own = sync.get(r["system"].split()[0], float("nan"))
        written = f"{r['written_s']:.2f}" if r["written_s"] is not None else "-"
        during = f"{r['step_writing_s']:.2f}" if r["step_writing_s"] is not None else "-"
        steps = f"{r['step_s']:.2f}" if r["step_s"] is not None else "-"
        print(f"{r['system']:<20}{r['first_wall_s']:>9.2f}{r['wall_s']:>11.2f}{r['cpu_s']:>8.2f}"
              f"{r['wall_s'] / own:>12.3f}{written:>11}{steps:>8}{during:>16}"
              f"{r['interval_s']:>12.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"checkpoint-save-{stamp}.json"
    shape = {"layers": args.layers, "width": args.width, "saves": args.saves,
             "between": args.between}  # fmt: skip
    out.write_text(json.dumps({**provenance(), **shape, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
