"""Pipeline stages of even predicted time (``pipeline.split: auto``, issue 47).

A pipeline runs as fast as its slowest stage: every micro-batch waits for it. The units of the
model are cut into consecutive stages so that the slowest stage's predicted time (its forward
and backward of one micro-batch, node by node under the cost model) is as small as it can be.
A unit's time is what the stage cut would give a stage holding that unit alone
(:class:`zerocc.compiler.parallel.stage_cut.StageAssignment`): the first unit's includes the
model's code before it (the embeddings), the last unit's the code after it (final norm, output
head, loss). Those ends are heavy in language models (the head's matmul over the vocabulary),
so the balanced split gives the first and last stages fewer blocks, and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.parallel.stage_cut import StageAssignment, unit_of
from zerocc.compiler.passes.partition import assign_units
from zerocc.compiler.plan import Plan
from zerocc.compiler.units import FROZEN, ROOT
from zerocc.cost.model import CostModel
from zerocc.cost.rates import rates_for
from zerocc.errors import PlanError
from zerocc.ir.nodes import PARAM, info
from zerocc.ir.quantities import human_bytes


@dataclass(frozen=True)
class StageSplit:
    """Units per stage, and what each stage was predicted to take and hold."""

    stage_units: tuple[tuple[str, ...], ...]
    seconds: tuple[float, ...]  # forward and backward of one micro-batch
    param_bytes: tuple[int, ...]  # the parameters the stage holds
    ends: tuple[float, float]  # seconds of the model's code before the first unit, after the last

    def format(self) -> str:
        """Each stage's units, time and parameters, and why the split is so."""
        lines = []
        for s, (units, seconds) in enumerate(zip(self.stage_units, self.seconds, strict=True)):
            held = f"{len(units)} units ({units[0]} .. {units[-1]})" if units[1:] else units[0]
            lines.append(
                f"stage {s}: {held}, predicted "
                f"{seconds * 1e3:.2f} ms forward and backward per micro-batch, parameters "
                f"{human_bytes(self.param_bytes[s])}"
            )
        mean = sum(self.seconds) / len(self.seconds)
        first, last = self.ends
        lines.append(
            f"split to even out predicted time: the slowest stage takes "
            f"{max(self.seconds) * 1e3:.2f} ms, {max(self.seconds) / mean - 1:.0%} above the "
            f"mean; the first stage also runs the model's code before its first unit "
            f"({first * 1e3:.2f} ms: embeddings), the last the code after its last unit "
            f"({last * 1e3:.2f} ms: final layers, head and loss)"
        )
        return "\n".join(lines)


def balance_stages(
    gm: fx.GraphModule, units: Sequence[str], stages: int, cost: CostModel
) -> StageSplit:
    """Cut ``units`` (module FQNs, in the order the captured step ``gm`` runs them) into
    ``stages`` consecutive groups of least maximal predicted time under ``cost``."""
    if not 1 <= stages <= len(units):
        raise PlanError(
            f"pipeline: {stages} stages need as many units or more, and the model has "
            f"{len(units)}: ask for at most {len(units)} stages (parallel.pp x "
            "pipeline.stages_per_rank), or cut the model into smaller units (units.classes)"
        )
    alone = StageAssignment(gm, [[u] for u in units])
    seconds = [0.0] * len(units)
    ends = [0.0, 0.0]
    unit_names = set(units)
    for node, unit in alone.stage.items():
        seconds[unit] += cost(node)
        if unit_of(info(node).module or "", unit_names) is None and unit in (0, len(units) - 1):
            ends[unit > 0] += cost(node)
    held = _params_held(gm, alone)
    groups = _least_max_partition(seconds, stages)
    stage_units = tuple(tuple(units[i] for i in group) for group in groups)
    return StageSplit(
        stage_units,
        tuple(sum(seconds[i] for i in group) for group in groups),
        tuple(_bytes_of(held, group) for group in groups),
        (ends[0], ends[1]),
    )


def _params_held(gm: fx.GraphModule, alone: StageAssignment) -> dict[int, dict[str, int]]:
    """Per unit, the parameters (FQN: bytes) its nodes read."""
    held: dict[int, dict[str, int]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and info(node).role == PARAM:
            value = node.meta["val"]
            for user in node.users:
                if user in alone.stage:
                    held.setdefault(alone.stage[user], {})[info(node).key] = (
                        value.numel() * value.element_size()
                    )
    return held


def _bytes_of(held: dict[int, dict[str, int]], group: list[int]) -> int:
    params: dict[str, int] = {}
    for unit in group:
        params.update(held.get(unit, {}))
    return sum(params.values())


def _least_max_partition(weights: Sequence[float], parts: int) -> list[list[int]]:
    """``range(len(weights))`` cut into ``parts`` non-empty consecutive groups whose largest
    sum is least (dynamic programming over the last cut)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: least largest sum of the first i items in k groups; cut[k][i]: where the
    # k-th group begins
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    groups, end = [], n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        groups.append(list(range(start, end)))
        end = start
    return groups[::-1]


def split_units(
    plan: Plan, gm: fx.GraphModule, model: ModelInfo, shard_size: int
) -> tuple[tuple[tuple[str, ...], ...], StageSplit | None]:
    """The units of each pipeline stage of ``plan`` for the captured step ``gm`` of ``model``:
    balanced on predicted time (``pipeline.split: auto``, with the :class:`StageSplit` that
    says why) or beginning where the plan names (None)."""
    pipeline = plan.pipeline
    units = [
        u.name
        for u in assign_units(
            model, shard_size, plan.units.classes, plan.units.modules, plan.units.min_mb
        )
        if u.name != ROOT and not u.name.endswith(FROZEN)
    ]
    stages = plan.parallel.pp * pipeline.stages_per_rank_of()
    if pipeline.split == "auto":
        split = balance_stages(gm, units, stages, CostModel(rates_for(plan), 1))
        return split.stage_units, split
    return _named_split(units, pipeline.split), None


def _named_split(units: list[str], starts: list[str]) -> tuple[tuple[str, ...], ...]:
    """The units grouped into stages that begin at ``starts`` (after the first stage)."""
    unknown = [s for s in starts if s not in units]
    if unknown:
        raise PlanError(
            f"pipeline.split: {unknown} are not units of the model; its units, in order: "
            f"{units} (units.classes and units.modules make them)"
        )
    at = [units.index(s) for s in starts]
    if at != sorted(at) or at[0] == 0:
        raise PlanError(
            f"pipeline.split: {starts} must name units in model order, after the first unit "
            f"({units[0]}), where each stage after the first begins"
        )
    bounds = [0, *at, len(units)]
    return tuple(tuple(units[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
