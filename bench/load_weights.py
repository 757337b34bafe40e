"""Host memory and time of starting from a Hugging Face model folder: transformers'
``from_pretrained`` (the whole model on each rank) against zerocc's ``pretrained`` (the model
on ``meta``, each unit's weights read from the files as the rank builds its shards).

A Llama-style model (``--hidden``, ``--layers``, ``--vocab``) is saved once in bf16 (as hub
checkpoints are) to a temporary folder. Each row is one process, one rank of ``--world-sizes``
simulated ranks (``zerocc.FakeComm``: the shards of rank 0), ZeRO-3, fp32 AdamW, on the CPU:
the model loaded, ``zerocc.compile`` building its states. Measured: the rank's model states
(``step.state.bytes_by_location()``), its peak resident memory above the resident set before
the load (``VmHWM``), peak over states, and the wall and CPU seconds of load plus compile;
median over ``--rounds`` processes. On one host, ``N`` ranks hold ``N`` times the row. With
``--device cuda`` the states are on the GPU and the peak is the host's alone.

    python bench/load_weights.py                         # ~0.3B Llama, 1 and 8 ranks
    python bench/load_weights.py --layers 2 --hidden 64 --vocab 256 --rounds 1   # smoke

Prints a table and writes ``bench/results/load-weights-<date>.json``.
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

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("transformers", "zerocc")
MB = 2**20

SAVE = r"""
import json, sys, torch, transformers
args = json.loads(sys.argv[1])
hidden = args["hidden"]
config = transformers.LlamaConfig(
    vocab_size=args["vocab"], hidden_size=hidden, intermediate_size=hidden * 11 // 4,
    num_hidden_layers=args["layers"], num_attention_heads=max(1, hidden // 64),
    num_key_value_heads=max(1, hidden // 256), max_position_embeddings=2048)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
model = model.to_empty(device="cpu").to(torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.save_pretrained(args["folder"])
print(sum(p.numel() for p in model.parameters()))
"""

CHILD = r"""
import gc, json, sys, time, torch
sys.path.insert(0, {bench!r})
from measure import peak_rss_bytes, reset_peak_rss, rss_bytes
import transformers, zerocc
from zerocc.workloads.huggingface import pretrained
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
plan = {{"zero": {{"stage": 3}}, "units": {{"classes": ["LlamaDecoderLayer"]}},
        "optimizer": {{"name": "adamw"}}, "backend": {{"device": args["device"]}}}}
gc.collect()
base = rss_bytes()
reset_peak_rss()
wall, cpu = time.perf_counter(), time.process_time()
if args["system"] == "transformers":
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(args["folder"], dtype=torch.float32).train()
else:
    model = pretrained(args["folder"])
step = zerocc.compile(model, plan, comm=zerocc.FakeComm(args["world"]))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
states = step.state.bytes_by_location()
print(json.dumps({{"states": sum(s["total"] for s in states.values()),
                  "peak": peak_rss_bytes() - base, "wall_s": wall, "cpu_s": cpu}}))
"""


def _run(code: str, args: dict) -> str:
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{args}: {(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", help="where the states go (cuda: host peak alone)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        params = int(_run(SAVE, {**shape, "folder": folder}))
        for world in args.world_sizes:
            for system in SYSTEMS:
                runs = [
                    json.loads(_run(CHILD.format(bench=str(Path(__file__).parent)),
                                    {"system": system, "world": world, "folder": folder,
                                     "device": args.device}))
                    for _ in range(args.rounds)
                ]  # fmt: skip
                row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append({"system": system, "world": world, **row, "runs": runs})
    print(f"\nstarting from a model folder: Llama {args.layers} x {args.hidden}, vocabulary "
          f"{args.vocab} ({params / 1e6:.1f}M parameters, bf16 files), ZeRO-3 fp32 AdamW, "
          f"one rank of N, states on {args.device}, median of {args.rounds}")  # fmt: skip
    print(f"{'system':<14}{'N':>3}{'states MiB':>12}{'peak MiB':>10}{'peak/states':>13}"
          f"{'wall s':>8}{'CPU s':>7}{'peak × zerocc':>15}")  # fmt: skip
    for r in rows:
        ours = next(o for o in rows if o["system"] == "zerocc" and o["world"] == r["world"])
        print(f"{r['system']:<14}{r['world']:>3}{r['states'] / MB:>12.1f}{r['peak'] / MB:>10.1f}"
              f"{r['peak'] / r['states']:>13.2f}{r['wall_s']:>8.2f}{r['cpu_s']:>7.2f}"
              f"{r['peak'] / ours['peak']:>15.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"load-weights-{stamp}.json"
    report = {**shape, "params": params, "device": args.device, "rows": rows}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
