"""``TrainStep.explain()``: units, communication per step, model-state bytes vs ZeRO's formula."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from zerocc.ir import GRAD, OPTIM_STATE, PARAM_FULL, PARAM_SHARD, info, op_name
from zerocc.printing import human_bytes
from zerocc.state import optimizer_states, state_specs

if TYPE_CHECKING:
    from zerocc.train_step import TrainStep

_CATEGORY = {PARAM_FULL: "params", PARAM_SHARD: "params", GRAD: "grads", OPTIM_STATE: "optimizer"}


def model_state_bytes(step: TrainStep) -> dict[str, int]:
    """Bytes of the live persistent params, grads and optimizer states of this rank (measured)."""
    roles = {
        s.key: s.role for s in state_specs(step.units, step.plan.zero.stage, step.plan.optimizer)
    }
    seen: set[int] = set()
    out: dict[str, int] = defaultdict(int)
    for key, tensor in step.state.items():
        category = _CATEGORY.get(roles.get(key, ""))
        storage = tensor.untyped_storage()
        if category is None or storage.data_ptr() in seen:
            continue  # a view of another state tensor (stage 1-2 shards) is no extra memory
        seen.add(storage.data_ptr())
        out[category] += storage.nbytes()
    out["total"] = sum(out.values())
    return dict(out)


def formula_bytes(step: TrainStep) -> dict[str, float]:
    """ZeRO's model-state bytes per rank for this plan: what each stage keeps whole or sharded."""
    stage, n = step.plan.zero.stage, step.comm.world_size
    states = len(optimizer_states(step.plan.optimizer))
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for u in step.units:
        psi = u.padded_numel * u.dtype.itemsize
        out["params"] += psi / n if stage == 3 else psi
        if u.trainable:
            out["grads"] += psi if stage <= 1 else psi / n
            out["optimizer"] += states * (psi / n if stage >= 1 else psi)
    out["total"] = sum(out.values())
    return out


def comm_bytes_per_step(step: TrainStep) -> dict[str, int]:
    """Bytes per collective kind moved per optimizer step (per rank): the stepping program plus
    ``grad_accumulation - 1`` accumulating ones, for the first batch shape compiled."""
    out: dict[str, int] = defaultdict(int)
    if not step.programs:
        return {}
    k = step.plan.grad_accumulation
    signature = next(iter(step.programs))[0]
    for (sig, boundary), program in step.programs.items():
        if sig != signature:
            continue
        times = 1 if boundary else k - 1
        for node in program.gm.graph.nodes:
            if info(node).stream == "comm" and info(node).bytes:
                name = op_name(node.target).removeprefix("zerocc.")
                kind = name.removesuffix("_start").removesuffix("_into")
                out[kind] += times * info(node).bytes
    return dict(out)


def explain_step(step: TrainStep) -> str:
    """A plain-text report: units, communication per step (once a program is compiled, at the
    first call), and model-state bytes per rank measured next to ZeRO's formula."""
    plan, n = step.plan, step.comm.world_size
    psi = sum(u.padded_numel for u in step.units if u.trainable)
    lines = [
        f"zerocc step: ZeRO stage {plan.zero.stage}, world size {n}, {len(step.units)} units, "
        f"{plan.optimizer.name}, grad_accumulation {plan.grad_accumulation}",
        f"trainable Ψ = {psi:,} elements with padding "
        f"({sum(u.numel for u in step.units if u.trainable):,} without)",
        "",
        f"{'unit':<28}{'params':>7}{'elements':>12}{'padded':>12}{'shard':>11}  trainable",
    ]
    for u in step.units:
        lines.append(
            f"{u.name:<28}{len(u.params):>7}{u.numel:>12,}{u.padded_numel:>12,}"
            f"{u.shard_numel:>11,}  {'yes' if u.trainable else 'no (frozen)'}"
        )
    lines += ["", "communication per optimizer step, per rank:"]
    if not step.programs:
        lines.append("  (known once the step is compiled, at its first call)")
    itemsize = step.units[0].dtype.itemsize
    for kind, nbytes in sorted(comm_bytes_per_step(step).items()):
        lines.append(
            f"  {kind:<16}{human_bytes(nbytes):>12}  ({nbytes / itemsize / max(psi, 1):.2f} Ψ)"
        )
    measured, formula = model_state_bytes(step), formula_bytes(step)
    lines += ["", f"model states per rank{'':<7}{'measured':>12}{'ZeRO formula':>14}"]
    for cat in ("params", "grads", "optimizer", "total"):
        lines.append(
            f"  {cat:<26}{human_bytes(measured.get(cat, 0)):>12}{human_bytes(formula[cat]):>14}"
        )
    return "\n".join(lines)


def describe(step: TrainStep) -> dict[str, Any]:
    """The figures of :func:`explain_step` as a dict, for tools and tests."""
    return {
        "model_state_bytes": model_state_bytes(step),
        "formula_bytes": formula_bytes(step),
        "comm_bytes_per_step": comm_bytes_per_step(step),
    }
