"""Which candidates of `zerocc plan auto` are compiled (:func:`pruned_search`), and what
each one is (:class:`Candidate`); the search itself is :mod:`zerocc.inspect.plan_search`.

Compiling a candidate of a 70B-class model for 1024 ranks takes ~2.5 s on this
machine's CPU, and the search's space holds 138 of them. Most need not be compiled, given two
orders the cost model keeps (the rest of the plan alike, on one mesh):

- *memory*: a later ZeRO stage, recomputing every unit and offloading the optimizer each need
  no more memory per rank (:data:`SAVES_MEMORY`): a candidate that saves no more than one
  that does not fit does not fit either;
- *time*: stages 1 to 3, recomputation and offload are each no faster (:data:`NO_FASTER`;
  stage 0 is outside that order: it updates every parameter on every rank, and can be slower
  than stage 1's sharded update): a candidate that goes further than one already slower than
  the best that fits is not faster than that best.

First, a candidate whose model states alone (parameters, gradients and optimizer states on the
device, from the layout its plan declares: no compile) are over the memory is pruned: they
are a lower bound of its peak, which the memory order then uses as a compiled peak. Then the
search compiles, among what is left, the candidate whose time has the lowest known bound
(the slowest of what it goes further than; the orders' roots first), and right after one that
does not fit, the candidate of its mesh and stage that saves the most memory (if that does not
fit either, nothing of that stage or an earlier one does), then its mesh's (nothing of the mesh,
then); it stops when nothing is left.
Pruned candidates are listed with the candidate that rules them out. The pick is the
exhaustive search's wherever the orders hold (a test compares both); ``exhaustive=True``
(`zerocc plan auto --exhaustive`) compiles every candidate, as the benchmark that checks the
model against measured runs does. A 70B-class GPT on 1024 ranks: 17 of 138 candidates
compiled, 1 min 42 s (the 92 without every-other-unit recompute took 5 min 46 s compiled one
by one); each compiled on shallow copies of the model (:mod:`zerocc.inspect.plan_depth`), 22 s
for the 238 of a space with sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zerocc.ir.quantities import human_bytes

# Recomputing some of the units (every other one, a list of their names): between none and all.
SOME = "some"
# Plan fields the search tries, with their values, where the plan does not set them (SOME: the
# units' list, where there are 2 or more), in the order each saves memory, least first (see
# the module's doc) ...
SAVES_MEMORY: dict[str, tuple[Any, ...]] = {
    "zero.stage": (0, 1, 2, 3),
    "recompute.units": ("none", SOME, "all"),
    "offload.optimizer": ("none", "cpu"),
    # (under tp: the norms and residuals on 1/tp of the tokens; tried where tp_layers are named)
    "parallel.sequence_parallel": (False, True),
}
# ... and cost time, fastest first (stage 0 is in no order with the others).
NO_FASTER: dict[str, tuple[Any, ...]] = {**SAVES_MEMORY, "zero.stage": (1, 2, 3)}


@dataclass(frozen=True)
class Candidate:
    """One plan the search compiled: the fields it set, and what it is predicted to need and
    take (or why it could not be compiled)."""

    fields: dict[str, Any]
    peak: int = 0  # bytes per rank at the step's peak (on the device)
    step_s: float = 0.0
    bound_by: str = ""  # what most of the step is: compute, communication or offload copies
    moved: dict[str, int] = field(default_factory=dict)  # mesh group -> bytes per step
    error: str | None = None
    pruned: str | None = None  # why it was not compiled (the search's orders rule it out)
    # What one step trains on over every rank: tokens where the workload counts them, else
    # batches (a tp group's ranks share one: tensor parallelism trains on fewer per step)
    work: int = 1
    # Its figures drawn from compiles of shallow copies of the model (zerocc.inspect.plan_depth)
    extrapolated: bool = False

    def fits(self, memory: int) -> bool:
        return self.predicted and self.peak <= memory

    @property
    def predicted(self) -> bool:
        """Whether it was compiled and its figures predicted."""
        return self.error is None and self.pruned is None

    @property
    def seconds_per_work(self) -> float:
        """Step time per token (or batch): what the candidates are ranked by."""
        return self.step_s / self.work

    def moved_text(self) -> str:
        return ", ".join(f"{g} {human_bytes(n)}" for g, n in sorted(self.moved.items()) if n)

    def describe(self) -> str:
        return ", ".join(f"{k}: {_shown(v)}" for k, v in self.fields.items()) or (
            "(the plan as it is)"
        )


def _shown(value: Any) -> str:
    """A field's value in the table: a list of units by its count and first ones; None (a
    field left to its default, as a pipeline's micro-batches) as ``default``."""
    if value is None:
        return "default"
    if isinstance(value, list) and len(value) > 2:
        return f"[{value[0]}, {value[1]}, … {len(value)} units]"
    return str(value)


def _position(order: dict[str, tuple[Any, ...]], path: str, value: Any) -> int | None:
    """Where ``value`` of field ``path`` lies along ``order`` (None: outside it); a list of
    units to recompute at :data:`SOME`."""
    chain = order.get(path, ())
    value = SOME if isinstance(value, list) else value
    return chain.index(value) if value in chain else None


def _further(a: dict[str, Any], b: dict[str, Any], order: dict[str, tuple[Any, ...]]) -> bool:
    """Whether ``b`` differs from ``a`` only by going further along ``order``'s fields."""
    if a == b:
        return False
    for path, value in a.items():
        if b[path] == value:
            continue
        mine, theirs = _position(order, path, value), _position(order, path, b[path])
        if mine is None or theirs is None or theirs <= mine:
            return False
    return True


def pruned_search(
    space: list[dict[str, Any]],
    predict: Callable[[dict[str, Any]], Candidate],
    states: Callable[[dict[str, Any]], int],
    memory: int,
) -> list[Candidate]:
    """The candidates of ``space``, each compiled (``predict``) or pruned (see the module's
    docstring): first those whose model states alone (``states``: bytes per rank on the
    device, from the layout, no compile) are over ``memory``; then by the orders, the one
    with the lowest bound on its time compiled next."""
    # The candidate of each mesh and stage, and of each mesh, that saves the most memory: after
    # one that does not fit, its stage's (if that does not fit either, nothing of its stage or
    # an earlier one does), then its mesh's.
    tops: dict[tuple, dict[str, Any]] = {}
    for fields in space:
        for key in (_column(fields), _mesh(fields)):
            if key not in tops or _level(fields) > _level(tops[key]):
                tops[key] = fields
    done: list[Candidate] = []
    left = []
    for fields in space:
        held = states(fields)
        if held > memory:  # (a lower bound of its peak: what the memory rule reads below)
            why = f"pruned: its model states alone need {human_bytes(held)} per rank"
            done.append(Candidate(fields, peak=held, pruned=why))
        else:
            left.append(fields)
    last: Candidate | None = None  # the last compiled
    while left:
        best = min((c.seconds_per_work for c in done if c.fits(memory)), default=None)
        still = []
        for fields in left:
            reason = _ruled_out(fields, done, best, memory)
            if reason is not None:
                done.append(Candidate(fields, pruned=reason))
            else:
                still.append(fields)
        if not still:
            break

        def bound(fields: dict[str, Any]) -> tuple[float, int]:
            before = [c.seconds_per_work for c in done
                      if c.predicted and _further(c.fields, fields, NO_FASTER)]  # fmt: skip
            return max(before, default=0.0), _time_level(fields)

        tried = [] if last is None or not last.predicted or last.fits(memory) else [
            tops[_column(last.fields)], tops[_mesh(last.fields)]
        ]  # fmt: skip
        chosen = next((top for top in tried if any(f is top for f in still)), None)
        chosen = chosen or min(still, key=bound)
        last = predict(chosen)
        done.append(last)
        left = [f for f in still if f is not chosen]
    return done


def _time_level(fields: dict[str, Any]) -> int:
    """How far along the time order ``fields`` go, in all; stage 0 counted past stage 3 (it
    needs the most memory: compiled after stage 1, which rules it out where it does not fit)."""
    return sum(
        len(NO_FASTER[path]) if (at := _position(NO_FASTER, path, value)) is None else at
        for path, value in fields.items()
        if path in NO_FASTER
    )


def _mesh(fields: dict[str, Any]) -> tuple:
    """A candidate's fields outside the orders (its mesh)."""
    return tuple((k, v) for k, v in fields.items() if k not in SAVES_MEMORY)


def _column(fields: dict[str, Any]) -> tuple:
    """A candidate's mesh (its fields outside the orders) and ZeRO stage."""
    return tuple((k, v) for k, v in fields.items() if k not in SAVES_MEMORY or k == "zero.stage")


def _level(fields: dict[str, Any]) -> int:
    """How far along the memory order ``fields`` go, in all (the orders' roots: 0)."""
    return sum(_position(SAVES_MEMORY, path, value) or 0 for path, value in fields.items())


def _ruled_out(
    fields: dict[str, Any], done: list[Candidate], best: float | None, memory: int
) -> str | None:
    """Why the candidate ``fields`` needs no compiling (None: it does)."""
    for c in done:
        if c.error is not None:
            continue
        if (c.predicted and best is not None and c.seconds_per_work > best
                and _further(c.fields, fields, NO_FASTER)):  # fmt: skip
            return f"pruned: no faster than {c.describe()}, slower than the best"
        # (a candidate pruned for its model states: its peak is their bytes, a lower bound)
        if c.peak > memory and _further(fields, c.fields, SAVES_MEMORY):
            return (f"pruned: needs more than {c.describe()}, which needs "
                    f"{human_bytes(c.peak)}")  # fmt: skip
    return None
