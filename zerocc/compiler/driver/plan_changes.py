"""Plans one change away from a plan that need less memory: what an
:class:`~zerocc.errors.InsufficientMemoryError` proposes (:mod:`zerocc.runtime.memory_check`
predicts each one's figure).

Each change is a few plan fields, written as YAML (``zero.stage: 3, offload.optimizer: cpu``),
and the valid plan they make; or another world size, the smallest that fits.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from pydantic import ValidationError

from zerocc.compiler.driver.pass_manager import check_passes
from zerocc.compiler.plan import Plan
from zerocc.errors import PlanError

NVME_PATH_HINT = "<folder on a local disk>"  # written for offload.nvme_path when it is unset
MAX_WORLD_SIZE = 2**16  # larger than any job that runs today


@dataclasses.dataclass(frozen=True)
class PlanChange:
    """A change of the plan an error proposes: as YAML fields, and the plan it makes."""

    text: str
    plan: Plan


def plan_changes(plan: Plan, device: torch.device, *, recompute: bool) -> list[PlanChange]:
    """Valid plans that need less memory than ``plan``, each one change away: recomputation
    (``recompute``), a higher stage, optimizer offload, and optimizer and parameter offload at
    stage 3, to host memory (on a GPU only: on a CPU-only machine it is the same memory) or to
    NVMe; an offloaded optimizer's gradients kept on the GPU (less host memory), or fewer of
    them on their way to the host at once (less device memory)."""
    stage, offload = plan.zero.stage, plan.offload
    options: list[dict[str, Any]] = []
    if recompute:
        options.append({"recompute.units": "all"})
    if offload.optimizer != "none" and offload.grads == "cpu" and offload.grads_in_flight != 1:
        options.append({"offload.grads_in_flight": 1})
    if offload.updates_on_host(device):
        options.append({"offload.grads": "device"})
    options += [{"zero.stage": s} for s in range(stage + 1, 4)]
    for where in ("cpu", "nvme") if device.type == "cuda" else ("nvme",):
        ratio = {"offload.ratio": 1.0} if offload.enabled else {}
        options.append({"zero.stage": max(stage, 1), "offload.optimizer": where, **ratio})
        options.append(
            {"zero.stage": 3, "offload.optimizer": where, "offload.params": where, **ratio}
        )
    changes, seen = [], set()
    for option in options:
        option = {k: v for k, v in option.items() if plan_field(plan, k) != v}
        if "nvme" in option.values() and not offload.nvme_path:
            option["offload.nvme_path"] = NVME_PATH_HINT
        text = ", ".join(f"{k}: {v}" for k, v in option.items())
        derived = derive_plan(plan, option) if option else None
        if derived is not None and text not in seen:
            seen.add(text)
            changes.append(PlanChange(text, derived))
    return changes


def plan_field(plan: Plan, path: str) -> Any:
    """The value of the plan's field at the dotted ``path`` (``zero.stage``)."""
    value: Any = plan
    for name in path.split("."):
        value = getattr(value, name)
    return value


def plan_sets(plan: Plan, path: str) -> bool:
    """Whether the plan's data set the field at the dotted ``path`` (not its default)."""
    *parents, leaf = path.split(".")
    section: Any = plan
    for name in parents:
        if name not in section.model_fields_set:
            return False
        section = getattr(section, name)
    return leaf in section.model_fields_set


def set_field(data: dict[str, Any], path: str, value: Any) -> None:
    """Set the field at the dotted ``path`` of plan data, making its sections where missing."""
    *parents, leaf = path.split(".")
    for name in parents:
        data = data.setdefault(name, {})
    data[leaf] = value


def derive_plan(plan: Plan, option: dict[str, Any]) -> Plan | None:
    """``plan`` with the dotted fields of ``option`` set, validated, its `passes` included
    (None if invalid, e.g. a `passes` list that does not name the pass the change needs)."""
    data = plan.model_dump()
    for path, value in option.items():
        set_field(data, path, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan's own warnings were shown when it loaded
        try:
            derived = Plan.model_validate(data)
            check_passes(derived)
        except (ValidationError, PlanError):
            return None
    derived._source = plan.source
    return derived


def smallest_world_size(fits: Callable[[int], bool], world_size: int) -> int | None:
    """The smallest world size above ``world_size`` that ``fits``, up to ``MAX_WORLD_SIZE``
    (None if none does). Per-rank state shrinks as ranks are added, down to what every rank
    keeps whole, which padding to a multiple of the world size grows again at very large
    world sizes: the search doubles to the first size that fits, then bisects below it."""
    low, high = world_size, world_size * 2
    while not fits(high):
        if high >= MAX_WORLD_SIZE:
            return None
        low, high = high, min(high * 2, MAX_WORLD_SIZE)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high
