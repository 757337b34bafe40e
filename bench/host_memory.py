"""Resident memory of an offloaded step against what zerocc predicts it holds (issue 22).

One process per plan (its own resident set): the example GPT (12 × 768 by default, 85.6M
parameters), ZeRO-3 on one rank, bf16 compute, AdamW with clipping, offload as the plan says.
For each plan it prints the model states by pool (what ``step.state.bytes_by_location()``
measures), the copies' host buffers (``step.transfers.host_buffers``), the predicted peak of
the step (states + the memory check's ``step_need``: activations, gathered units, host
buffers) and the measured peak: ``VmHWM`` over steps 2-4 above the resident set before
``zerocc.compile``, ``measured / predicted`` and ``measured / states`` (the issue's goal:
at most 1.1 plus a constant on a GPU machine). On a GPU machine (``--device cuda``) the
device's states are not host memory: the prediction and the states count host memory only (on
the CPU they count the device's too, and the activations are host memory as well).

    python bench/host_memory.py                       # the plans below, CPU
    python bench/host_memory.py --layers 24 --device cuda

Prints a table and writes ``bench/results/host-memory-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent
PLANS = {
    "opt-cpu": {"offload": {"optimizer": "cpu"}},
    "opt-cpu one-pass": {"offload": {"optimizer": "cpu"}, "kernels": "one-pass"},
    "opt-par-cpu": {"offload": {"optimizer": "cpu", "params": "cpu"}},
    "opt-cpu r0.5": {"offload": {"optimizer": "cpu", "ratio": 0.5}},
    # A compute-copy host buffer per unit (2 bytes per element) beside the gradients' buffers.
    "opt-cpu delayed": {"offload": {"optimizer": "cpu", "defer_updates": "delayed"}},
    # Gradients kept on the device until their updates: two units' host buffers, not all.
    "opt-cpu grads-dev": {"offload": {"optimizer": "cpu", "grads": "device"}},
}
MB = 2**20

CHILD = r"""
import gc, json, sys, torch
sys.path.insert(0, {gpt!r})
import zerocc
from model import GPT, GPTConfig
from zerocc.runtime.memory_check import step_need

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

args = json.loads({args!r})
torch.manual_seed(0)
cfg = GPTConfig(block_size=256, vocab_size=512, n_layer=args["layers"], n_head=8, n_embd=768)
model = GPT(cfg).to(args["device"])
params = sum(p.numel() for p in model.parameters())
case = args["case"]
plan = {{"zero": {{"stage": 3}}, "units": {{"classes": ["Block"]}},
        "optimizer": {{"name": "adamw", "lr": 1e-3, "grad_clip": 1.0}},
        "precision": {{"param": "bf16"}}, "offload": case["offload"],
        "backend": {{"device": args["device"], "kernels": case.get("kernels", "auto")}}}}
x = torch.randint(0, 512, (2, 256)); y = torch.randint(0, 512, (2, 256))
gc.collect()
base = status("VmRSS")
step = zerocc.compile(model, plan)
del model
step(x, y)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
for _ in range(3):
    step(x, y)
gc.collect()
states = step.state.bytes_by_location()
device = torch.device(args["device"])
need = step_need(step._last_program.gm, device, gloo=step.comm.on_gloo)
host_states = states["host"]["total"] + (states["device"]["total"] if device.type == "cpu" else 0)
predicted = host_states + sum(need.get("host", {{}}).values())
print(json.dumps({{
    "params": params, "device_states": states["device"]["total"],
    "host_states": states["host"]["total"], "host_buffers": step.transfers.host_buffers.nbytes,
    "predicted": predicted, "states": host_states, "measured": status("VmHWM") - base,
}}))
"""


def run(name: str, case: dict, layers: int, device: str) -> dict:
    args = json.dumps({"case": case, "layers": layers, "device": device})
    code = CHILD.format(gpt=str(ROOT / "examples" / "gpt"), args=args)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return {"plan": name, "error": (done.stderr or done.stdout).strip().splitlines()[-1]}
    return {"plan": name, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--device", default="cpu")
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    rows = [run(name, PLANS[name], args.layers, args.device) for name in args.plans]
    print(f"\nhost memory of an offloaded step, GPT {args.layers} x 768, {args.device}")
    print(f"{'plan':<18}{'dev MiB':>9}{'host MiB':>10}{'buffers':>9}{'predicted':>11}"
          f"{'measured':>10}{'meas/pred':>10}{'meas/states':>12}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['plan']:<18} {r['error']}")
            continue
        print(f"{r['plan']:<18}{r['device_states'] / MB:>9.1f}{r['host_states'] / MB:>10.1f}"
              f"{r['host_buffers'] / MB:>9.1f}{r['predicted'] / MB:>11.1f}"
              f"{r['measured'] / MB:>10.1f}{r['measured'] / r['predicted']:>10.3f}"
              f"{r['measured'] / r['states']:>12.3f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"host-memory-{args.device}-{stamp}.json"
    report = {"layers": args.layers, "device": args.device, "rows": rows}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
