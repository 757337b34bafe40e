"""Compile a plan for N simulated ranks without running anything, and estimate its cost.

``zerocc inspect`` and ``zerocc estimate`` sit on this: the plan's workload gives the model and a
batch (rank 0's first); the step is captured on fake tensors and the passes run for
``world_size`` ranks. No parameter is allocated, so a model built on the ``meta`` device of any
size inspects in seconds, for 8 ranks or 1024.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerocc.compiler.batch import as_batch
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.driver.program import CapturedSteps, CompiledProgram
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.opaque import region_lines
from zerocc.compiler.parallel.experts import exchange_lines
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan import Plan, load_plan
from zerocc.compiler.state import HOST, NVME
from zerocc.compiler.units import Unit
from zerocc.compiler.workload import Workload, load_workload, workload_code
from zerocc.cost.memory import model_state_bytes_of, predict_memory, snapshot_bytes_of
from zerocc.cost.rates import DeviceRates, rates_for
from zerocc.cost.simulate import Simulation, predict_step
from zerocc.cost.timeline import MemoryTimeline
from zerocc.errors import PlanError
from zerocc.inspect.explain import (
    comm_bytes,
    gradients_copied_out,
    held_gradient_bytes,
    recompute_cost,
    transfer_bytes,
)


@dataclass
class Inspection:
    """A plan compiled for ``world_size`` ranks: the program that steps (and, with gradient
    accumulation, the one that only accumulates), each with its pass records."""

    plan: Plan
    world_size: int
    mesh: Mesh  # the ranks' layout, the session's
    programs: dict[bool, CompiledProgram]  # boundary -> program

    @property
    def stepping(self) -> CompiledProgram:
        return self.programs[True]

    @property
    def units(self) -> list[Unit]:
        return self.stepping.units


def inspect_plan(
    plan: Plan | str | dict,
    world_size: int,
    workload: Workload | None = None,
    *,
    keep_graphs: bool = False,
    captured: CapturedSteps | None = None,
) -> Inspection:
    """Compile ``plan`` for ``world_size`` ranks (its ``workload`` unless one is given), on fake
    tensors. ``keep_graphs`` keeps the graph after every pass (for printing one unit, DOT).
    ``captured``: steps captured before (another plan's for the same model), reused where
    they fit; the programs of gradient accumulation share one capture either way."""
    plan = load_plan(plan)
    workload = workload or load_workload(plan)
    session = CompileSession.open(workload.model, plan, world_size, workload.loss_fn)
    batch = first_batch(workload, session.mesh.data_parallel)
    boundaries = [True] if plan.grad_accumulation == 1 else [True, False]
    captured = captured or (CapturedSteps() if len(boundaries) > 1 else None)
    programs = {
        boundary: session.program(
            batch,
            boundary=boundary,
            device=torch.device("cpu"),
            keep_graphs=keep_graphs,
            captured=captured,
        )
        for boundary in boundaries
    }
    return Inspection(plan, world_size, session.mesh, programs)


def first_batch(workload: Workload, data_ranks: int) -> tuple[Any, ...]:
    """Rank 0's first batch of ``data_ranks`` (what a compile-only run captures on)."""
    with workload_code(f"batches(0, {data_ranks})"):
        batch = next(iter(workload.batches(0, data_ranks)), None)
    if batch is None:
        raise PlanError(f"workload: batches(0, {data_ranks}) yielded no batch")
    return as_batch(batch)


@dataclass
class Estimate:
    """Per-rank memory, communication and time of one optimizer step, predicted from the
    program."""

    stage: int
    world_size: int
    model_states: dict[str, int]  # params, grads, optimizer, total (exact: the plan's state)
    peak: dict[str, int]  # total, and gathered / activations at their own highest
    comm: dict[str, int]  # bytes per collective kind per optimizer step
    offloaded: dict[str, int]  # model-state bytes off the device: host, nvme
    transfers: dict[str, int]  # bytes offload moves per step: to_host, to_device, nvme_read, ...
    recompute: dict[str, Any]  # ops, flops, step_flops, units the recompute pass added
    timeline: MemoryTimeline = field(repr=False)
    timing: Simulation | None = field(default=None, repr=False)  # the simulated step
    rates: DeviceRates | None = None  # the cost model's rates behind ``timing``
    # Bytes of the gradients the updates read (grad_accumulation 1: not model state, held from
    # their reduction to the update within the step; part of the activations' peak)
    held_grads: int = 0
    psi: int = 0  # trainable elements, with padding
    grads_copied_out: bool = False  # offloaded gradients leave the device during backward
    notes: list[str] = field(default_factory=list)  # what the figures leave out (opaque regions)
    mesh: Mesh | None = field(default=None, repr=False)  # the ranks' layout (the session's)

    @property
    def snapshot_bytes(self) -> int:
        """One in-memory snapshot of a rank's state (``checkpoint.in_memory``): every state it
        keeps, on the device, in host memory and on NVMe (its header and RNG states aside)."""
        return snapshot_bytes_of({**self.model_states, **self.offloaded})

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain data (``zerocc estimate --json``)."""
        out = {
            "stage": self.stage,
            "world_size": self.world_size,
            "model_states": self.model_states,
            "peak": self.peak,
            "comm_bytes_per_step": self.comm,
            "offloaded_model_states": self.offloaded,
            "transfer_bytes_per_step": self.transfers,
            "recompute": self.recompute,
            "held_gradient_bytes": self.held_grads,
            "snapshot_bytes": self.snapshot_bytes,
            "notes": self.notes,
        }
        if self.timing is not None and self.rates is not None:
            timing = {k: v for k, v in self.timing.as_dict().items() if k != "peak_bytes"}
            out["timing"] = {
                **timing,
                "rates": self.rates.as_dict(),
                "rate_sources": dict(self.rates.sources),
                "uncalibrated": self.rates.uncalibrated(),  # a warning, or None
            }
        return out


def estimate(inspection: Inspection, rates: DeviceRates | None = None) -> Estimate:
    """Model states from the plan's state layout; transient memory by liveness over the
    stepping program; bytes per collective kind per step (accumulating programs included);
    the step's time, simulated with ``rates`` (default: :func:`zerocc.cost.rates.rates_for` the
    plan)."""
    plan = inspection.plan
    rates = rates or rates_for(plan)
    states = model_state_bytes_of(inspection.stepping.layout)
    timeline = predict_memory(inspection.stepping.gm, states, gloo=rates.on_gloo)
    index, total = timeline.peak()
    peak = {
        "total": total,
        "gathered": max(timeline.series["gathered"], default=0),
        "activations": max(timeline.series["activations"], default=0),
        "comm": max(timeline.series["comm"], default=0),
        "host_buffers": timeline.host_peak,
        "at": index,
    }
    programs = {b: p.gm for b, p in inspection.programs.items()}
    comm = comm_bytes(programs, plan.grad_accumulation)
    transfers = transfer_bytes(programs, plan.grad_accumulation)
    offloaded = {where: states.get(where, 0) for where in (HOST, NVME)}
    timing = predict_step(
        programs,
        plan.grad_accumulation,
        rates,
        inspection.world_size,
        mesh=inspection.mesh,
    )
    timing.peak_bytes, timing.memory = total, timeline
    return Estimate(
        plan.zero.stage,
        inspection.world_size,
        states,
        peak,
        comm,
        offloaded,
        transfers,
        recompute_cost(programs, plan.grad_accumulation),
        timeline,
        timing,
        rates,
        held_gradient_bytes(inspection.stepping.gm),
        sum(u.padded_numel for u in inspection.units if u.trainable),
        gradients_copied_out(inspection.stepping.gm),
        region_lines([inspection.stepping.gm])
        + exchange_lines([inspection.stepping.gm], plan.parallel.ep),
        inspection.mesh,
    )


def _captured(record: PassRecord) -> str:
    """The capture row's note: what its header says after the time it took (the layers split,
    the opaque regions, the repeated layers traced once)."""
    said = record.header.partition("; ")[2]
    return f"(the captured step: {said})" if said else "(the captured step)"


def pass_table(records: list[PassRecord]) -> list[list[str]]:
    """Rows (header first) of what each pass did: time, node counts, ops inserted/removed."""
    rows = [["pass", "ms", "nodes", "added", "removed", "ops inserted"]]
    for r in records:
        inserted = ", ".join(
            f"{name.removeprefix('zerocc.')} ×{n}"
            for name, n in sorted(r.ops_added.items(), key=lambda kv: (kv[0][:5] == "aten.", kv))
        )
        rows.append(
            [
                r.name,
                f"{r.seconds * 1e3:.1f}",
                str(r.nodes_after),
                f"+{max(r.nodes_after - r.nodes_before, 0)}" if r.name != "capture" else "",
                f"-{sum(r.ops_removed.values())}" if r.ops_removed else "",
                _captured(r) if r.name == "capture" else inserted or "-",
            ]
        )
    return rows
