"""A deep model's candidates screened on shallow copies of it, for `zerocc plan auto` (issue
52).

Compiling one candidate of a 70B-class model (80 blocks) for 1024 ranks takes ~2.5-3.5 s on
this machine, nearly all of it proportional to the graph, which is the same block 80 times.
What a step needs grows by the same amount with each block: its model states, the
activations it saves, its compute and its collectives are the block's once more; what is
not (the embedding, the head, the loss, the optimizer's first and last ops) is the same at
any depth. So the search compiles each candidate on two copies of the model whose stack of
blocks is cut to :data:`DEPTHS` blocks (:meth:`BlockStack.cut`: only the modules on the way
to the stack are copied; every block, parameter and other module is shared) and draws the
line through the two: peak memory, step time and bytes per mesh group at the model's depth
(:func:`extrapolated`). A step's figures are a line in the depth once the peak and the
overlap have their steady shape (a stage-3 step gathers at most the block it computes and
the one it prefetches; recomputing every other unit repeats every 2 blocks, so both depths
are even). The peak is the largest of what is live at each point of the step, each a line in
the depth, so it is convex in the depth: the line through two depths is a lower bound beyond
them where a part that grows faster takes the peak over later, which is why the pick is
compiled whole.

The line ranks the candidates; the plan written is compiled whole: the fastest candidate that
fits by its line is compiled at the model's depth, and again for the next while the one
compiled whole does not fit or a candidate's line is faster than it (:func:`confirmed`), so
the chosen plan's peak and step are the estimator's own, as `zerocc estimate` gives them.
What this gives up: a candidate whose line is over the memory by less than the line's error
and which fits whole is not tried whole. Pipelines, whose stages split the units, are
compiled whole; a candidate a shallow copy cannot compile (a plan naming a block beyond the
cut) too.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from zerocc.inspect.plan_pruning import Candidate

# A stack of fewer blocks than this is compiled whole: the copies (10 blocks) would save little.
MIN_DEPTH = 16
# Blocks of the two shallow copies: even (every-other-unit recompute repeats every 2 blocks),
# and past where the peak keeps its place (at 2 blocks of the example GPT under stage 3 and
# recompute, the head's backward holds it; from 4 on, the blocks' activations do).
DEPTHS = (4, 6)
# A line this close to a time compiled whole is the same time (the line's rounding)
TIE = 1e-9


@dataclass(frozen=True)
class BlockStack:
    """The model's stack of repeated blocks: the container (``nn.ModuleList`` or
    ``nn.Sequential``) at ``fqn`` holding ``depth`` blocks of class ``kind``."""

    fqn: str
    kind: str
    depth: int

    @staticmethod
    def of(model: nn.Module, min_depth: int = MIN_DEPTH) -> BlockStack | None:
        """The stack of at least ``min_depth`` blocks of one class that holds the most
        parameters (a transformer's layers); None when the model has none."""
        found: tuple[int, BlockStack] | None = None
        for fqn, module in model.named_modules():
            if not isinstance(module, nn.ModuleList | nn.Sequential):
                continue
            blocks = list(module._modules.values())
            if len(blocks) < min_depth or len({type(b) for b in blocks}) != 1:
                continue
            held = sum(p.numel() for p in module.parameters())
            if found is None or held > found[0]:
                found = (held, BlockStack(fqn, type(blocks[0]).__name__, len(blocks)))
        return found[1] if found is not None else None

    def cut(self, model: nn.Module, depth: int) -> nn.Module:
        """A copy of ``model`` whose stack holds its first ``depth`` blocks (the same
        modules and parameters; the modules on the way to the stack are shallow copies)."""
        return _cut(model, self.fqn.split(".") if self.fqn else [], depth)

    def describe(self) -> str:
        return f"{DEPTHS[0]} and {DEPTHS[1]} of its {self.depth} {self.kind}s"


def _cut(module: nn.Module, path: list[str], depth: int) -> nn.Module:
    twin = copy.copy(module)  # (its __dict__ copied: the dict of its children is replaced below)
    if not path:
        twin._modules = dict(list(module._modules.items())[:depth])
        return twin
    twin._modules = dict(module._modules)
    child = module._modules[path[0]]
    assert child is not None  # (BlockStack.of found the stack through it)
    twin._modules[path[0]] = _cut(child, path[1:], depth)
    return twin


def extrapolated(points: Sequence[Candidate], depths: Sequence[int], depth: int) -> Candidate:
    """The candidate at ``depth`` blocks on the line through its figures at ``depths``
    (``points``, compiled on the shallow copies): peak, step and bytes per mesh group; what
    bounds it as at the deeper copy."""
    (a, b), (da, db) = points, depths

    def line(x: float, y: float) -> float:
        return x + (y - x) * (depth - da) / (db - da)

    moved = {g: round(line(a.moved.get(g, 0), b.moved.get(g, 0))) for g in a.moved | b.moved}
    return replace(
        b,
        peak=round(line(a.peak, b.peak)),
        step_s=line(a.step_s, b.step_s),
        moved=moved,
        extrapolated=True,
    )


def confirmed(
    candidates: list[Candidate],
    whole: Callable[[dict[str, Any]], Candidate],
    memory: int,
) -> list[Candidate]:
    """``candidates`` with the fastest that fit compiled whole (``whole``) in place of their
    lines, until no line that fits is faster than the fastest compiled whole that fits."""
    out = list(candidates)
    while True:
        fitting = [c for c in out if c.fits(memory)]
        best = min((c.seconds_per_work for c in fitting if not c.extrapolated), default=math.inf)
        faster = [c for c in fitting
                  if c.extrapolated and c.seconds_per_work < best * (1 - TIE)]  # fmt: skip
        if not faster:
            return out
        top = min(faster, key=lambda c: c.seconds_per_work)
        out[out.index(top)] = replace(whole(top.fields), work=top.work)
