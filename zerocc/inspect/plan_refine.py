"""The knobs `zerocc plan auto` tunes around its pick rather than across its space
(:data:`REFINED`), and the hill-climb that tries them again around a faster pick so found
(:func:`climb`): its blocks two to a unit, its collectives in buckets of two of its largest
units, at stage 3 one more unit gathered ahead, and where it offloads, half its units'
states offloaded."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from zerocc.compiler.driver.plan_changes import plan_sets
from zerocc.compiler.plan import Plan
from zerocc.compiler.units import Unit
from zerocc.inspect.plan_pruning import Candidate

# Knobs tuned around the pick, not across the space (:func:`refinements`): each moves a step
# by a few percent (on the 70B example's estimate at 1024 ranks, buckets of two blocks -1.5%,
# a second unit prefetched +0.5%; on the 4-block example on either rates, buckets cost more
# than they save), where trying them everywhere would multiply the candidates by 8
BLOCKS = "units.blocks_per_unit"
BUCKETS, PREFETCH = "overlap.bucket_mb", "overlap.prefetch"
RATIO = "offload.ratio"  # (a pick that offloads: half its units' states offloaded instead)
REFINED = (BLOCKS, BUCKETS, PREFETCH, RATIO)
# Rounds of the knobs' tuning at most (each a faster pick: a second knob on the first, ...)
MAX_CLIMBS = 4


def climb(
    candidates: list[Candidate],
    memory: int,
    around: Callable[[Candidate], list[Candidate]],
    confirm: Callable[[list[Candidate]], list[Candidate]],
) -> list[Candidate]:
    """``candidates`` with those the knobs make around the fastest that fits (``around``:
    the new ones, predicted), and again around a faster one so found (a second knob on the
    first, prefetch one deeper), until none is faster, :data:`MAX_CLIMBS` rounds at most;
    ``confirm`` compiles whole the lines that would win (:func:`plan_depth.confirmed`)."""
    best = fastest_that_fits(candidates, memory)
    for _ in range(MAX_CLIMBS):
        if best is None:
            break
        candidates = confirm([*candidates, *around(best)])
        climbed = fastest_that_fits(candidates, memory)
        if climbed is None or climbed.fields == best.fields:
            break
        best = climbed
    return candidates


def fastest_that_fits(candidates: list[Candidate], memory: int) -> Candidate | None:
    fitting = [c for c in candidates if c.fits(memory)]
    return min(fitting, key=lambda c: (c.seconds_per_work, c.peak), default=None)


def refinements(
    plan: Plan, fields: dict[str, Any], picked: Plan, bucket_mb: float
) -> list[dict[str, Any]]:
    """The pick's ``fields`` (its plan: ``picked``) with each of :data:`REFINED` changed,
    where the plan leaves it: its blocks two to a unit (unless it recomputes units it names),
    its collectives in buckets of two of its largest units (``bucket_mb``; 0: fewer than two
    units, neither), at stage 3 one more unit gathered ahead, and where it offloads, half
    its units offloaded (faster, where the memory allows it)."""
    out = []
    named = isinstance(picked.recompute.units, list)  # (units by name: grouping renames them)
    if bucket_mb and not named and not plan_sets(plan, BLOCKS):
        out.append({**fields, BLOCKS: 2})
    if bucket_mb and not plan_sets(plan, BUCKETS):
        out.append({**fields, BUCKETS: bucket_mb})
    if picked.zero.stage == 3 and not plan_sets(plan, PREFETCH):
        out.append({**fields, PREFETCH: picked.overlap.prefetch + 1})
    offloads = picked.offload.optimizer != "none" or picked.offload.params != "none"
    if offloads and picked.offload.ratio == 1 and not plan_sets(plan, RATIO):
        out.append({**fields, RATIO: 0.5})
    return out


def two_units_mb(plan: Plan, units: list[Unit]) -> float:
    """A bucket (``overlap.bucket_mb``) that two of the largest of ``units`` (the model's
    trainable ones) fill, gathered in the compute dtype, whole MB rounded up: their
    collectives as one, what units of two blocks would send (each unit still freed on its
    own); 0 for fewer than 2 units."""
    if len(units) < 2:
        return 0.0
    itemsize = plan.precision.dtype("param").itemsize
    return float(math.ceil(2 * max(u.numel for u in units) * itemsize / 2**20))
