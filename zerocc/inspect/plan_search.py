"""`zerocc plan auto`: the fastest plan that fits, found with the cost model (issue 52).

The plan names the workload and whatever the user fixes; every field of the search space that
the plan leaves out is tried: the ZeRO stage (0-3), recomputation (none, all) and, on a GPU, the
optimizer's offload to host memory. Each candidate is compiled for the world size on fake
tensors, as `zerocc estimate` compiles a plan (a meta model of any size), and its peak memory
per rank and step time predicted; those over the memory a rank has are dropped and the rest
ranked by step time. A candidate that cannot be compiled (a plan error) is listed with why.

The candidates differ only in what the passes do, so the step is captured once and each
candidate's passes run on a copy of it (:class:`~zerocc.compiler.driver.program.CapturedSteps`).
Searching units, meshes and micro-batches, which change the capture, is the issue's next step.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from zerocc.compiler.driver.plan_changes import derive_plan, plan_field
from zerocc.compiler.driver.program import CapturedSteps
from zerocc.compiler.plan import Plan
from zerocc.compiler.workload import Workload, load_workload
from zerocc.cost.model import DeviceRates, rates_for
from zerocc.errors import PlanError, ZeroccError
from zerocc.inspect.estimate import estimate, inspect_plan
from zerocc.ir.printing import human_bytes, human_seconds

# Plan fields the search tries, with their values, where the plan does not set them.
SPACE: dict[str, tuple[Any, ...]] = {
    "zero.stage": (0, 1, 2, 3),
    "recompute.units": ("none", "all"),
    "offload.optimizer": ("none", "cpu"),
}
HOST_ONLY = {"offload.optimizer"}  # fields that mean nothing where host memory is the device's


@dataclass(frozen=True)
class Candidate:
    """One plan the search compiled: the fields it set, and what it is predicted to need and
    take (or why it could not be compiled)."""

    fields: dict[str, Any]
    peak: int = 0  # bytes per rank at the step's peak (on the device)
    step_s: float = 0.0
    error: str | None = None

    def fits(self, memory: int) -> bool:
        return self.error is None and self.peak <= memory

    def describe(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.fields.items()) or "(the plan as it is)"


@dataclass(frozen=True)
class Search:
    """Every candidate, fastest first; the best is the fastest that fits ``memory`` per rank."""

    plan: Plan
    world_size: int
    memory: int
    rates: DeviceRates
    candidates: list[Candidate]
    fixed: list[str]  # fields of the space the plan sets, not searched

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits(self.memory)), None)

    def format(self) -> str:
        """The table of candidates and the choice, or why none fits."""
        lines = [
            f"{self.plan.source or 'plan'}: {len(self.candidates)} candidate plans on "
            f"{self.world_size} ranks, {human_bytes(self.memory)} per rank "
            f"({self.rates.device} rates)",
        ]
        if self.fixed:
            lines.append(f"fixed by the plan, not searched: {', '.join(self.fixed)}")
        lines.append(f"  {'step':>10}  {'peak':>10}  fits  plan")
        for c in self.candidates:
            if c.error is not None:
                lines.append(f"  {'-':>10}  {'-':>10}  -     {c.describe()}: {c.error}")
                continue
            fits = "yes" if c.fits(self.memory) else "no"
            lines.append(
                f"  {human_seconds(c.step_s):>10}  {human_bytes(c.peak):>10}  {fits:<4}  "
                f"{c.describe()}"
            )
        best = self.best
        if best is None:
            closest = min(
                (c for c in self.candidates if c.error is None),
                key=lambda c: c.peak,
                default=None,
            )
            over = (
                f" (the closest, {closest.describe()}, needs {human_bytes(closest.peak)})"
                if closest is not None
                else ""
            )
            lines.append(
                f"no candidate fits{over}: more ranks, offload to NVMe or a smaller batch "
                "would lower the peak (`zerocc estimate` prints the figures of each)"
            )
        else:
            lines.append(f"best: {best.describe()} ({why(best, self.candidates, self.memory)})")
        return "\n".join(lines)


def why(best: Candidate, candidates: list[Candidate], memory: int) -> str:
    """Why the best won: its time and peak, and what the faster candidates needed."""
    faster = [c for c in candidates if c.error is None and c.step_s < best.step_s]
    said = f"predicted step {human_seconds(best.step_s)}, peak {human_bytes(best.peak)}"
    if faster:
        least = min(c.peak for c in faster)
        said += (
            f"; {len(faster)} faster candidate(s) need {human_bytes(least)} or more, over "
            f"{human_bytes(memory)}"
        )
    return said


def search_space(plan: Plan, device: str) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
    """The fields to try and their values, and the fields the plan fixes (set in its file)."""
    space, fixed = {}, []
    for path, values in SPACE.items():
        if device != "cuda" and path in HOST_ONLY:
            continue
        if _set_in(plan, path):
            fixed.append(f"{path}: {plan_field(plan, path)}")
            continue
        space[path] = values
    return space, fixed


def _set_in(plan: Plan, path: str) -> bool:
    """Whether the plan's data set the field at ``path`` (not its default)."""
    *parents, leaf = path.split(".")
    section: Any = plan
    for name in parents:
        if name not in section.model_fields_set:
            return False
        section = getattr(section, name)
    return leaf in section.model_fields_set


def candidate_fields(space: dict[str, tuple[Any, ...]]) -> Iterator[dict[str, Any]]:
    """Every combination of the space's values."""
    for values in itertools.product(*space.values()):
        yield dict(zip(space, values, strict=True))


def search_plans(
    plan: Plan,
    world_size: int,
    memory: int,
    rates: DeviceRates | None = None,
    workload: Workload | None = None,
) -> Search:
    """Compile every candidate of ``plan``'s search space for ``world_size`` ranks and rank
    them (see the module's docstring); ``memory``: bytes a rank has on its device."""
    if plan.parallel.pp > 1:
        raise PlanError(
            "zerocc plan auto: parallel.pp > 1 is not searched yet; leave parallel.pp out to "
            "search the stages, recomputation and offload of a plan without a pipeline"
        )
    rates = rates or rates_for(plan)
    workload = workload or load_workload(plan)
    space, fixed = search_space(plan, rates.device)
    captured = CapturedSteps()  # (the candidates differ in their passes: one capture serves)
    candidates = []
    for fields in candidate_fields(space):
        changed = {k: v for k, v in fields.items() if plan_field(plan, k) != v}
        derived = derive_plan(plan, changed) if changed else plan
        if derived is None:
            continue  # (a combination the plan's schema refuses, e.g. a `passes` list)
        candidates.append(_predicted(fields, derived, world_size, rates, workload, captured))
    candidates.sort(key=lambda c: (c.error is not None, c.step_s, c.peak))
    return Search(plan, world_size, memory, rates, candidates, fixed)


def _predicted(
    fields: dict[str, Any],
    plan: Plan,
    world_size: int,
    rates: DeviceRates,
    workload: Workload,
    captured: CapturedSteps,
) -> Candidate:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (each candidate's notes: the table says enough)
            inspection = inspect_plan(plan, world_size, workload, captured=captured)
            predicted = estimate(inspection, rates)
    except ZeroccError as exc:
        return Candidate(fields, error=str(exc).splitlines()[0])
    step_s = predicted.timing.step_s if predicted.timing is not None else 0.0
    return Candidate(fields, predicted.peak["total"], step_s)


def best_plan_yaml(search: Search) -> str:
    """The best candidate as a plan file: the fields the plan set, the chosen ones beside
    them, and a comment saying why it won."""
    best = search.best
    if best is None:
        raise ZeroccError("zerocc plan auto: no candidate fits; nothing to write")
    data = search.plan.model_dump(mode="json", exclude_unset=True)
    for path, value in best.fields.items():
        *parents, leaf = path.split(".")
        section = data
        for name in parents:
            section = section.setdefault(name, {})
        section[leaf] = value
    header = [
        f"# Chosen by `zerocc plan auto` for {search.world_size} ranks, "
        f"{human_bytes(search.memory)} per rank, {search.rates.device} rates:",
        f"# {best.describe()}",
        f"# {why(best, search.candidates, search.memory)}",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False)
