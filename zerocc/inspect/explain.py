"""``TrainStep.explain()``: units, communication per step, model-state bytes vs ZeRO's formula."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import fx

from zerocc.compiler.opaque import region_lines
from zerocc.compiler.parallel.experts import exchange_lines
from zerocc.compiler.parallel.mesh import Mesh, mesh_lines
from zerocc.compiler.parallel.router_loss import router_loss_lines
from zerocc.compiler.plan import OffloadConfig
from zerocc.compiler.state import (
    DEVICE,
    LOCATIONS,
    Dtypes,
    optimizer_states,
    placements,
)
from zerocc.compiler.units import Unit
from zerocc.cost.model import collective_kind
from zerocc.ir.nodes import GRAD_SHARD, info, nodes_with_role, op_name, val
from zerocc.ir.ops import (
    PARAM_GATHERS,
    QUANTIZED_STARTS,
    SECONDARY_GROUP,
    TO_HOST,
    reported_kind,
)
from zerocc.ir.quantities import human_bytes
from zerocc.runtime.record import StepRecord

if TYPE_CHECKING:
    from zerocc.compiler.plan import Plan


def formula_bytes(step: StepRecord, location: str = DEVICE) -> dict[str, float]:
    """ZeRO's model-state bytes per rank for this plan at ``location``: what each stage keeps
    whole or sharded, in each state's dtype (with bf16 compute, reduce and grad and fp32
    master: 2 + 2 + 12 bytes per parameter, as the ZeRO paper counts), the offloaded units'
    master weights and optimizer states (and parameters) moved off the device. Gradients are
    state only where they are accumulated over micro-batches: with ``grad_accumulation: 1``
    each lives from its reduction to its update, within the step, and the formula counts none
    (:func:`held_gradient_bytes` says what ZeRO would count)."""
    return zero_formula(step.units, step.plan, step.mesh, location)


def zero_formula(
    units: list[Unit], plan: Plan, mesh: Mesh, location: str = DEVICE
) -> dict[str, float]:
    """:func:`formula_bytes` of ``plan`` for ``units`` on the ranks of ``mesh``."""
    zero = plan.zero
    n = mesh.shard_size  # the ranks a unit is sharded over
    states = len(optimizer_states(plan.optimizer))
    where = placements(units, plan.offload)
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for u in units:
        d = Dtypes.of(u, plan.precision if plan.precision.mixed else None)
        psi, place = u.padded_numel, where[u.name]
        if place.params == location:
            out["params"] += psi * d.param.itemsize / (n if zero.shards_params else 1)
        sharded = n if zero.shards_optimizer else 1
        if place.optimizer == location and (d.master != d.param or (u.trainable and place.split)):
            out["optimizer"] += psi * d.master.itemsize / sharded
        if u.trainable and location == DEVICE and plan.grad_accumulation > 1:
            out["grads"] += psi * d.gradient(zero).itemsize / (n if zero.shards_gradients else 1)
        if u.trainable and place.optimizer == location:
            out["optimizer"] += states * psi * d.master.itemsize / sharded
    out["total"] = sum(out.values())
    return out


def transfer_bytes_per_step(step: StepRecord) -> dict[str, int]:
    """Bytes offload moves per optimizer step per rank, by direction (to_host, to_device,
    host_to_host, nvme_read, nvme_write), as the compiled programs' copies record them."""
    programs = step.programs
    return transfer_bytes(programs, step.plan.grad_accumulation) if programs else {}


def transfer_bytes(programs: dict[bool, fx.GraphModule], grad_accumulation: int) -> dict[str, int]:
    """Bytes per transfer direction per optimizer step, from the programs that step (``True``)
    and accumulate (``False``)."""
    return _bytes_per_step(programs, grad_accumulation, "copy", lambda node: node.args[-1])


def _bytes_per_step(
    programs: dict[bool, fx.GraphModule],
    grad_accumulation: int,
    stream: str,
    kind: Callable[[fx.Node], str],
) -> dict[str, int]:
    """Bytes the start nodes on ``stream`` record, per ``kind(node)``, over one optimizer step:
    the stepping program once, the accumulating one ``grad_accumulation - 1`` times."""
    out: dict[str, int] = defaultdict(int)
    for boundary, gm in programs.items():
        times = 1 if boundary else grad_accumulation - 1
        for node in gm.graph.nodes:
            if info(node).stream == stream and info(node).bytes:
                out[kind(node)] += times * info(node).bytes
    return dict(out)


def recompute_cost(programs: dict[bool, fx.GraphModule], grad_accumulation: int) -> dict:
    """What recomputation costs per optimizer step: the ops the recompute pass copied into
    backward, their FLOPs (the cost model's count) against the step's, and the units."""
    from zerocc.cost.model import COMPUTE, node_work

    ops = flops = total = 0.0
    units: set[str] = set()
    for boundary, gm in programs.items():
        times = 1 if boundary else grad_accumulation - 1
        for node in gm.graph.nodes:
            work = node_work(node)
            done = times * work.flops if work.kind == COMPUTE else 0.0
            total += done
            note = info(node).note or ""
            if note.startswith("recomputed: forward of "):
                ops += times
                flops += done
                units.add(note.removeprefix("recomputed: forward of "))
    return {"ops": int(ops), "flops": flops, "step_flops": total, "units": sorted(units)}


def recompute_line(step: StepRecord) -> str:
    """One line: how much of the step recomputation adds (once a program is compiled)."""
    programs = step.programs
    if not programs:
        return "recomputation: known once the step is compiled, at its first call"
    return describe_recompute(recompute_cost(programs, step.plan.grad_accumulation))


def describe_recompute(cost: dict) -> str:
    """``recomputation: 5 units, 212 ops, +1.2 GFLOP per step (+24% of the step's FLOPs)``."""
    share = cost["flops"] / max(cost["step_flops"] - cost["flops"], 1)
    return (
        f"recomputation: {len(cost['units'])} units, {cost['ops']} ops, "
        f"+{cost['flops'] / 1e9:.3g} GFLOP per step (+{100 * share:.0f}% of the step's FLOPs)"
    )


def comm_bytes_per_step(step: StepRecord) -> dict[str, int]:
    """Bytes per collective kind moved per optimizer step (per rank): the stepping program plus
    ``grad_accumulation - 1`` accumulating ones, for the first batch shape compiled."""
    programs = step.programs
    return comm_bytes(programs, step.plan.grad_accumulation) if programs else {}


def comm_bytes(programs: dict[bool, fx.GraphModule], grad_accumulation: int) -> dict[str, int]:
    """Bytes per collective kind per optimizer step, from the programs that step (``True``) and
    accumulate (``False``), as their collectives record them (the experts' exchanges of rows
    as their calls' rows: routing taken as uniform)."""

    def kind(node: fx.Node) -> str:
        name = op_name(node.target)
        how = f" in {node.args[3]}" if name in QUANTIZED_STARTS else ""  # (its wire format)
        return reported_kind(collective_kind(node) + how, node.args[-1])

    return _bytes_per_step(programs, grad_accumulation, "comm", kind)


def unit_rows(units: list[Unit]) -> list[list[str]]:
    """A table of the units (header first): parameters, elements, padded size, shard size."""
    return [["unit", "params", "elements", "padded", "shard", "trainable"]] + [
        [u.name, str(len(u.params)), f"{u.numel:,}", f"{u.padded_numel:,}",
         f"{u.shard_numel:,}", "yes" if u.trainable else "no (frozen)"]
        for u in units
    ]  # fmt: skip


# What ``backend.kernels: auto`` chose, and why, as explain() says it.
AUTO_KERNELS = {
    "triton": "zerocc's Triton kernels, one fused pass per update, no host sync",
    "fused": "torch's fused optimizer kernels, one pass per update, no host sync",
    "torch": "the reference's torch ops: masters below fp32, or no fused kernels here",
}


def backend_line(step: StepRecord) -> str:
    """Which backend runs the program and which kernel set zerocc's ops call, with what
    ``auto`` chose on this device."""
    backend = step.plan.backend
    name = step.backend + (" (auto)" if backend.name == "auto" else "")
    line = f"backend {name} on {step.device_type}, kernels {step.kernels}"
    if backend.kernels == "auto":
        line += f" (auto: {AUTO_KERNELS[step.kernels]})"
    if step.host_kernels is not None:
        line += f"; host updates of offloaded units: {step.host_kernels}"
    return line


def setup_line(seconds: dict[str, float]) -> str:
    """Where the time before training went: ``setup: model states 1.2 s, ...``."""
    return "setup: " + ", ".join(f"{phase} {s:.1f} s" for phase, s in seconds.items())


def explain_step(step: StepRecord) -> str:
    """A plain-text report: units, communication per step (once a program is compiled, at the
    first call), and model-state bytes per rank measured next to ZeRO's formula."""
    plan, n = step.plan, step.world_size
    psi = sum(u.padded_numel for u in step.units if u.trainable)
    lines = [
        f"zerocc step: ZeRO stage {plan.zero.stage}, world size {n}, {len(step.units)} units, "
        f"{plan.optimizer.name}, grad_accumulation {plan.grad_accumulation}",
        f"trainable Ψ = {psi:,} elements with padding "
        f"({sum(u.numel for u in step.units if u.trainable):,} without)",
        *mesh_lines(step.mesh),
        *([step.units_note] if step.units_note else []),
        *region_lines(step.programs.values()),
        *exchange_lines(step.programs.values(), plan.parallel.ep),
        *router_loss_lines(  # (one program: the accumulating one is the same capture)
            list(step.programs.values())[:1],
            plan.grad_accumulation,
            step.mesh.data_parallel,
            pipeline=False,
        ),
        precision_line(step),
        *([step.float8_note] if step.float8_note else []),
        backend_line(step),
        *step.backend_notes,
        *([step.initial_weights] if step.initial_weights else []),
        *([setup_line(step.setup_seconds)] if step.setup_seconds else []),
        "",
    ]
    for name, params, elements, padded, shard, trainable in unit_rows(step.units):
        lines.append(f"{name:<28}{params:>7}{elements:>12}{padded:>12}{shard:>11}  {trainable}")
    lines += ["", "communication per optimizer step, per rank:"]
    if not step.programs:
        lines.append("  (known once the step is compiled, at its first call)")
    comm = comm_bytes_per_step(step)
    width = max([16, *(len(kind) + 2 for kind in comm)])
    for kind, nbytes in sorted(comm.items()):
        lines.append(
            f"  {kind:<{width}}{human_bytes(nbytes):>12}  ({nbytes / max(psi, 1):.2f} bytes per Ψ)"
        )
    if step.programs and not comm:
        lines.append(f"  {'none':<16}{human_bytes(0):>12}{no_communication(n)}")
    if step.programs:
        lines += ["", predicted_time_line(step)]
    measured, formula = step.model_state_bytes, formula_bytes(step)
    lines += ["", f"model states per rank{'':<7}{'measured':>12}{'ZeRO formula':>14}"]
    for cat in ("params", "grads", "optimizer", "total"):
        lines.append(
            f"  {cat:<26}{human_bytes(measured.get(cat, 0)):>12}{human_bytes(formula[cat]):>14}"
        )
    programs = step.programs
    if plan.grad_accumulation == 1 and True in programs:
        stepping = programs[True]
        held, leave = held_gradient_bytes(stepping), gradients_copied_out(stepping)
        lines.append(held_gradients_line(held, psi, n, leave=leave))
    if plan.zero.secondary_group > 1 and True in programs:
        lines += ["", secondary_line(programs[True], plan.zero.secondary_group, psi)]
    if step.plan.recompute.enabled:
        lines += ["", recompute_line(step)]
    if step.plan.offload.enabled:
        lines += ["", *offload_lines(step)]
    return "\n".join(lines)


def secondary_line(gm: fx.GraphModule, group: int, psi: int) -> str:
    """What the secondary partition holds: the parts of forward's gathers each rank keeps
    until backward gathers from them (what those gathers read)."""
    kept = [
        val(n.args[0])
        for n in gm.graph.nodes
        if op_name(n.target) in PARAM_GATHERS and n.args[-1] == SECONDARY_GROUP
    ]
    nbytes = sum(t.numel() * t.element_size() for t in kept)
    return (
        f"secondary partition (zero.secondary_group {group}, hpZ): {len(kept)} units' "
        f"1/{group} kept from forward to backward, {human_bytes(nbytes)} per rank at most "
        f"({nbytes / max(psi, 1):.2f} bytes per Ψ, in the gathered units' memory); backward "
        f"gathers them over the secondary groups of {group} ranks instead of the shard group"
    )


def no_communication(world_size: int) -> str:
    """Why a program communicates nothing (said next to its 0 bytes)."""
    return "  (one rank: nothing to gather or reduce)" if world_size == 1 else ""


def held_gradient_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the gradients a stepping program's updates read, per rank, held on the device:
    the reduced shards (at world size 1, backward's gradients), but those copied to the host
    as they complete (``offload.grads: cpu``), which leave the device as they go. With
    ``grad_accumulation: 1`` they are not model state: each lives from its reduction to its
    update, within the step."""
    return sum(
        val(n).numel() * val(n).element_size()
        for n in nodes_with_role(gm, GRAD_SHARD)
        if not copied_out_in_backward(n)
    )


def gradients_copied_out(gm: fx.GraphModule) -> bool:
    """Whether any gradient an update reads leaves the device during backward (copied to the
    host as it completes: ``offload.grads: cpu``, but under loss scaling)."""
    return any(copied_out_in_backward(n) for n in nodes_with_role(gm, GRAD_SHARD))


def copied_out_in_backward(grad: fx.Node) -> bool:
    """Whether ``grad`` is copied to the host in backward, not in the optimizer phase."""
    return any(
        op_name(u.target) in ("zerocc.copy_start", "zerocc.copy_into_start")
        and u.args[-1] == TO_HOST
        and info(u).phase != "optimizer"
        for u in grad.users
    )


def held_gradients_line(
    held: int, psi: int, world_size: int, width: int = 26, leave: bool = False
) -> str:
    """A row for the gradients when none is kept between steps (``grad_accumulation: 1``):
    the bytes the update reads, held on the device within the step (counted in its
    activations); ``leave``: offloaded units' gradients leave the device during backward
    (:func:`gradients_copied_out`)."""
    which, since = ("reduced", "their reduction") if world_size > 1 else ("backward's", "backward")
    return (
        f"  {'grads within the step':<{width}}{human_bytes(held):>12}  ({held / max(psi, 1):.2f} "
        f"bytes per Ψ, not kept between steps: the update reads {which} gradients, held from "
        f"{since} to it"
        + ("; an offloaded unit's leave the device as they are copied to the host" if leave else "")
        + ")"
    )


# What ``offload.defer_updates`` does to a step, as explain() says it.
DEFERRED_UPDATE_LINES = {
    "next_forward": [
        "  host updates carried into the next step (offload.defer_updates: next_forward): each "
        "runs beside the next forward, waited for before its unit's weights are first read; same "
        "numbers"
    ],
    "delayed": [
        "  host updates carried into the next step (offload.defer_updates: delayed): each runs "
        "beside the next forward and backward, its weights used a step later (gradients one "
        "step stale); a save, evaluate or state_dict applies the one in flight"
    ],
}
GRADS_LINES = {
    "cpu": "  reduced gradients copied to host buffers as backward reduces them "
    "(offload.grads: cpu, at most {in_flight} on their way at once): host memory of every "
    "offloaded shard",
    "device": "  reduced gradients kept on the device until their updates, each copied through "
    "one of two host buffers (offload.grads: device)",
}


def _grads_line(offload: OffloadConfig) -> str:
    """Where the offloaded optimizer's gradients wait for their updates."""
    in_flight = offload.grads_in_flight if offload.grads_in_flight is not None else "every one"
    return GRADS_LINES[offload.grads].format(in_flight=in_flight)


def offload_lines(step: StepRecord) -> list[str]:
    """Where every byte of the model states lives (device, host, NVMe; measured), and the
    traffic offload adds per optimizer step."""
    pools = step.state_bytes
    offloaded = [u for u, p in placements(step.units, step.plan.offload).items() if p.offloaded]
    lines = [
        f"offload: optimizer {step.plan.offload.optimizer}, params {step.plan.offload.params}, "
        f"{len(offloaded)} of {len(step.units)} units (ratio {step.plan.offload.ratio:g})",
        *DEFERRED_UPDATE_LINES.get(step.plan.offload.defer_updates, []),
        *([_grads_line(step.plan.offload)] if step.plan.offload.optimizer != "none" else []),
        f"where the model states live{'':<2}" + "".join(f"{w:>12}" for w in LOCATIONS),
    ]
    for cat in ("params", "grads", "optimizer", "total"):
        row = "".join(f"{human_bytes(pools[w].get(cat, 0)):>12}" for w in LOCATIONS)
        lines.append(f"  {cat:<26}{row}")
    lines.append("offload traffic per optimizer step, per rank:")
    if not step.programs:
        lines.append("  (known once the step is compiled, at its first call)")
    for direction, nbytes in sorted(transfer_bytes_per_step(step).items()):
        lines.append(f"  {direction:<16}{human_bytes(nbytes):>12}")
    return lines


def predicted_time_line(step: StepRecord) -> str:
    """The step's time as the cost model predicts it (``zerocc estimate``'s simulation of the
    compiled programs, with the plan's rates: ``plan.cost``, a calibration, or defaults)."""
    from zerocc.cost.rates import rates_for
    from zerocc.cost.simulate import predict_step

    programs = step.programs
    if len(programs) < (1 if step.plan.grad_accumulation == 1 else 2):
        return "predicted step time: known once every program of a step is compiled"
    rates = rates_for(step.plan, step.device_type)
    t = predict_step(
        programs,
        step.plan.grad_accumulation,
        rates,
        step.world_size,
        mesh=step.mesh,
    )
    source = "calibrated" if "calibration" in rates.sources.values() else "default"
    return (
        f"predicted step time: {t.step_s * 1e3:.1f} ms (compute {t.compute_s * 1e3:.1f} ms, "
        f"communication {t.comm_s * 1e3:.1f} ms, exposed {t.exposed_s * 1e3:.1f} ms = "
        f"{100 * t.exposed_fraction:.0f}%; {source} {rates.device} rates)"
    )


def precision_line(step: StepRecord) -> str:
    """Dtypes of compute, reduction and master weights; the loss scale, or what a non-finite
    gradient does; skipped steps."""
    p = step.plan.precision
    kept = p.kept_gradient(step.plan.zero)
    line = f"precision: compute {p.param}, reduce {p.reduce}, master {p.master}, grads {kept}"
    if step.loss_scale is not None:
        kind = "dynamic" if step.dynamic_loss_scale else "static"
        line += (
            f"; {kind} loss scale {step.loss_scale:g}, "
            f"{step.skipped_steps} of {step.steps + step.skipped_steps} steps skipped for overflow"
        )
    else:  # without loss scaling: what a step whose gradient is not finite does
        line += f"; non-finite gradients: {p.nonfinite}"
        if p.nonfinite == "skip":
            line += f", {step.skipped_steps} of {step.steps + step.skipped_steps} steps skipped"
    return line


def describe(step: StepRecord) -> dict[str, Any]:
    """The figures of :func:`explain_step` as a dict, for tools and tests."""
    return {
        "model_state_bytes": step.model_state_bytes,
        "formula_bytes": formula_bytes(step),
        "comm_bytes_per_step": comm_bytes_per_step(step),
        "state_bytes_by_location": step.state_bytes,
        "transfer_bytes_per_step": transfer_bytes_per_step(step),
        "loss_scale": step.loss_scale,
        "skipped_steps": step.skipped_steps,
    }
