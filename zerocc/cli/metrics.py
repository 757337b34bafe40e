"""What `zerocc train` reports while it trains (the plan's ``metrics`` section).

Every ``every`` optimizer steps the ranks pool what they saw since the last record (one small
object gather on the control group, where a peer gone is named as in a step): the loss as the
mean over ranks and micro-batches (the loss the step's gradient is the mean of), the tokens every
rank trained on per second of wall time, the learning rate the last step ran with, and on GPUs
the model FLOPs utilization and the peak memory of the busiest rank. Rank 0 shows it on the
progress line and appends it to a JSONL file and TensorBoard when asked. An evaluation loss on
the workload's held-back data runs every ``eval_every`` steps and at the end, through the step's
forward-only program.
"""

from __future__ import annotations

import json
import math
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import Workload, workload_code
from zerocc.cost.model import node_work
from zerocc.errors import NotSupportedError
from zerocc.ir.nodes import info
from zerocc.runtime.failures import gathered

# Dense peak TFLOP/s by compute dtype, from the datasheets (SXM parts; fp32 without TF32, as
# torch computes fp32 matmuls by default). A device not listed shows no MFU unless the plan
# gives `metrics.peak_tflops`.
PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
}


def peak_flops(device: torch.device, dtype: str, given_tflops: float | None) -> float | None:
    """The device's dense peak FLOP/s in ``dtype`` (the plan's, else the datasheet's for a
    known GPU), or None where it is unknown (a CPU, an unlisted GPU)."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for model, peaks in PEAK_TFLOPS.items():
        if model in name:
            return peaks[dtype] * 1e12
    return None


def model_flops(program: torch.fx.GraphModule) -> float:
    """FLOPs of one micro-batch's model computation: three times its forward's, the convention
    of MFU (backward costs twice forward; recomputation and the update are not counted)."""
    forward = 0.0
    for node in program.graph.nodes:
        if node.op == "call_function" and info(node).phase == "forward":
            forward += node_work(node).flops
    return 3 * forward


class Metrics:
    """Collects one rank's losses and tokens, pools them with the other ranks at each record,
    and (rank 0) shows and writes the records. Every rank calls every method at the same
    points: records and evaluations are collective."""

    def __init__(self, step: Any, plan: Plan, workload: Workload, rank: int) -> None:
        self.step, self.config, self.workload, self.rank = step, plan.metrics, workload, rank
        self.accum = plan.grad_accumulation
        self._counting = f"{plan.workload}: tokens_per_batch(batch)"
        self.peak = peak_flops(step.device, plan.precision.param, self.config.peak_tflops)
        self._flops: float | None = None
        self._losses: list[float] = []
        self._timed = 0  # micro-batches since the clock started (the first step's compile aside)
        self._tokens = 0
        self._since = time.perf_counter()
        self._eval: list[tuple] | None = None
        self.last: dict[str, Any] | None = None  # the newest record with a loss
        self.last_eval: tuple[int, float] | None = None  # (step, loss) of the newest eval
        self._file = self._tensorboard = None
        if rank == 0:
            self._open_outputs()

    def _open_outputs(self) -> None:
        if self.config.file is not None:
            path = Path(self.config.file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a")
        if self.config.tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise NotSupportedError(
                    f"metrics.tensorboard: {self.config.tensorboard} needs the tensorboard "
                    f'package: pip install tensorboard (or "zerocc[tensorboard]"): {exc}'
                ) from None
            self._tensorboard = SummaryWriter(self.config.tensorboard)

    def start_clock(self) -> None:
        """Start the throughput clock now: after the first micro-batch, whose time is mostly
        capture and compilation (its loss is recorded, its time and tokens are not)."""
        self._since = time.perf_counter()
        self._timed = self._tokens = 0

    def micro_batch(self, loss: float, batch: tuple) -> None:
        """After each micro-batch this rank ran: its loss and batch."""
        self._losses.append(loss)
        self._timed += 1
        if self.workload.tokens_per_batch is not None:
            with workload_code(self._counting):  # (the workload's code: said as its error)
                self._tokens += self.workload.tokens_per_batch(batch)

    def after_step(self, lr: float) -> dict[str, Any] | None:
        """After each optimizer step (``lr``: the rate it ran with): the pooled record when
        one is due (a collective), else None."""
        steps = self.step.micro_batches // self.accum
        if steps % self.config.every:
            return None
        record = self._pooled(steps, lr)
        if self.config.eval_every and steps % self.config.eval_every == 0:
            record["eval_loss"] = self.evaluate()
            self.start_clock()  # the evaluation's time is not training throughput
        self._write(record)
        return record

    def finish(self, lr: float) -> dict[str, Any] | None:
        """At the end: a record of what is left since the last one, with a final evaluation
        when evaluations are on and the last record had none (a collective)."""
        steps = self.step.micro_batches // self.accum
        # Every rank ran the same micro-batches (the step agrees on each): the same on all.
        record = self._pooled(steps, lr) if self._losses else None
        evaluated = (
            self.last is not None and self.last["step"] == steps and "eval_loss" in self.last
        )
        if self.config.eval_every and not evaluated:
            record = record or {"step": steps}
            record["eval_loss"] = self.evaluate()
        if record is not None:
            self._write(record)
        return record

    def _pooled(self, steps: int, lr: float) -> dict[str, Any]:
        now = time.perf_counter()
        seconds = max(now - self._since, 1e-9)
        memory = None
        if self.step.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.step.device)
            torch.cuda.reset_peak_memory_stats(self.step.device)
        mine = (math.fsum(self._losses), len(self._losses), self._timed, self._tokens, memory)
        pooled = self._gathered(mine, f"the metrics' gather after step {steps}")
        count, timed = sum(p[1] for p in pooled), sum(p[2] for p in pooled)
        record: dict[str, Any] = {
            "step": steps,
            "loss": math.fsum(p[0] for p in pooled) / count if count else None,
            "lr": lr,
        }
        if timed:  # throughput of the micro-batches timed (the first one is not)
            record["steps_per_s"] = timed / len(pooled) / self.accum / seconds
            if self.workload.tokens_per_batch is not None:
                # (the ranks of a tensor-parallel group train on one batch: counted once)
                tokens = sum(p[3] for p in pooled) * self.step.data_parallel / len(pooled)
                record["tokens_per_s"] = tokens / seconds
            if self.peak is not None:
                flops = self._model_flops() * timed  # every rank's micro-batches
                record["mfu"] = flops / seconds / (self.peak * len(pooled))
        if memory is not None:
            record["max_memory_bytes"] = max(p[4] for p in pooled)
        self._losses.clear()
        self._timed = self._tokens = 0
        self._since = now
        return record

    def _model_flops(self) -> float:
        """FLOPs of one call of this rank's step (a pipeline rank's: its stages' part of every
        micro-batch it runs, so that the ranks' calls sum to the model's work)."""
        if self._flops is None:
            programs = self.step.counted_programs()
            self._flops = sum(runs * model_flops(gm) for gm, runs in programs)
        return self._flops

    def evaluate(self) -> float | None:
        """The mean loss over every rank's eval batches (the same number on each: the fewest
        any rank has), forward only; None when the workload holds no data back."""
        batches = self._eval_batches()
        if not batches:
            return None
        from zerocc.runtime.rank import to_device

        total = math.fsum(
            float(self.step.evaluate(*to_device(b, self.step.device))) for b in batches
        )
        steps = self.step.micro_batches // self.accum
        where = f"the evaluation's gather after step {steps}"
        pooled = self._gathered((total, len(batches)), where)
        return math.fsum(p[0] for p in pooled) / sum(p[1] for p in pooled)

    def _eval_batches(self) -> list[tuple]:
        if self._eval is None:
            made = self.workload.eval_batches
            mine = []
            if made is not None:
                ranks = (self.step.data_rank, self.step.data_parallel)  # one per tp group
                with workload_code(f"eval_batches{ranks}"):
                    mine = list(islice(made(*ranks), self.config.eval_batches))
            counts = self._gathered(len(mine), "the ranks' count of eval batches")
            if len(set(counts)) > 1 and self.rank == 0:
                print(f"eval: the ranks hold {counts} eval batches; each evaluates {min(counts)}")
            self._eval = mine[: min(counts)]
        return self._eval

    def _gathered(self, value: Any, where: str) -> list[Any]:
        """Every rank's ``value``: a peer gone or silent meanwhile is named as in a step
        (``zerocc.runtime.failures.gathered``), not the process group's own error."""
        health = getattr(self.step, "health", None)  # (a pipeline's step has none of its own)
        return gathered(self.step.comm, value, where, health)

    def _write(self, record: dict[str, Any]) -> None:
        if "loss" in record:
            self.last = record
        if record.get("eval_loss") is not None:
            self.last_eval = record["step"], record["eval_loss"]
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            for name, value in record.items():
                if name != "step" and value is not None:
                    self._tensorboard.add_scalar(
                        f"train/{name}" if name != "eval_loss" else "eval/loss",
                        value,
                        record["step"],
                    )
            self._tensorboard.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def progress_text(record: dict[str, Any]) -> dict[str, str]:
    """The progress line's fields of a record."""
    shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.3g}"}
    if "tokens_per_s" in record:
        shown["tok/s"] = f"{record['tokens_per_s']:.4g}"
    if "mfu" in record:
        shown["mfu"] = f"{record['mfu']:.1%}"
    if "max_memory_bytes" in record:
        shown["mem"] = f"{record['max_memory_bytes'] / 2**30:.1f}GiB"
    if record.get("eval_loss") is not None:
        shown["eval"] = f"{record['eval_loss']:.4f}"
    return shown
