"""Which parameters an update that needs whole matrices (Muon) takes, and the rank that owns
each matrix's update.

Muon's groups (``optimizer.groups``, by glob over parameter names; a parameter in no group by
Moonlight's convention): hidden 2-D matrices take Muon; embeddings (a parameter of an
``Embedding`` module, or named as one), the output head (``lm_head``, ``head``, ``output``, or
tied to an embedding), norms' and biases' vectors take AdamW. A parameter a group gives Muon
that is not 2-D is a plan error naming it (torch.optim.Muon refuses it as well).

Owners: the orthogonalization of a ``rows × cols`` matrix costs ``∝ rows · cols · min(rows,
cols)`` (:func:`newton_schulz_cost`); the matrices are handed out largest first, each to the
rank with the least cost so far (the longest-processing-time rule: within 4/3 of the best
balance), over the whole model, since every rank takes part in every unit's exchange.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from zerocc.compiler.capture import ModelInfo, ParamInfo
from zerocc.compiler.names import glob_matches
from zerocc.compiler.units import Unit
from zerocc.errors import PlanError

# Parameters that take AdamW by default under a Muon plan, by name (any of a tied parameter's
# names): embeddings and the output head, as Moonlight's training code keeps them from Muon.
ADAMW_NAMES = ("**embed**", "**wte**", "**wpe**", "**lm_head**", "head.*", "output.*")
EMBEDDING_CLASSES = ("Embedding", "EmbeddingBag")


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """The relative cost of orthogonalizing a matrix (or a stack ``[E, rows, cols]``):
    ``E · rows · cols · min(rows, cols)``."""
    rows, cols = shape[-2:]
    return math.prod(shape[:-2]) * rows * cols * min(rows, cols)


def assign_owners(shapes: dict[str, Sequence[int]], ranks: int) -> dict[str, int]:
    """The rank (0 .. ranks-1) that owns each matrix's update (by name), balanced by
    :func:`newton_schulz_cost`: largest first (ties by name), each to the least loaded rank
    (ties: the lowest)."""
    if ranks < 1:
        raise ValueError(f"owners among {ranks} ranks: at least 1")
    load = [0] * ranks
    owners: dict[str, int] = {}
    for name in sorted(shapes, key=lambda n: (-newton_schulz_cost(shapes[n]), n)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += newton_schulz_cost(shapes[name])
    return owners


@dataclass(frozen=True)
class OwnedMatrix:
    """One matrix a Muon update orthogonalizes whole: its parameter, its unit, where it lies in
    the unit's flat buffer, its shape and the rank that owns its update."""

    fqn: str
    unit: str
    offset: int
    shape: tuple[int, ...]
    owner: int

    @property
    def numel(self) -> int:
        """Elements of the matrix."""
        return math.prod(self.shape)


def _embedding_params(model: ModelInfo) -> set[str]:
    embeddings = {fqn for fqn, cls in model.modules if cls in EMBEDDING_CLASSES}
    return {
        p.fqn
        for p in model.params
        if any(name.rpartition(".")[0] in embeddings for name in p.aliases)
    }


def muon_params(model: ModelInfo, groups: Iterable[tuple[Sequence[str], str]]) -> set[str]:
    """The trainable parameters (first FQNs) that take Muon. ``groups``: (globs, optimizer name)
    in the plan's order; the first group one of a parameter's names matches decides, else the
    default (a 2-D parameter that is no embedding and no output head). A parameter a group gives
    Muon that is not 2-D is a :class:`PlanError`."""
    groups = list(groups)
    embeddings = _embedding_params(model)
    chosen: set[str] = set()
    for p in model.trainable:
        name = _group_of(p, groups)
        if name is None:
            default_adamw = p.fqn in embeddings or any(
                glob_matches(alias, g) for alias in p.aliases for g in ADAMW_NAMES
            )
            name = "adamw" if len(p.shape) != 2 or default_adamw else "muon"
        elif name == "muon" and len(p.shape) != 2:
            raise PlanError(
                f"optimizer.groups: {p.fqn} (shape {list(p.shape)}) is given Muon, which "
                "orthogonalizes 2-D matrices only; give it adamw (a group before this one)"
            )
        if name == "muon":
            chosen.add(p.fqn)
    return chosen


def _group_of(param: ParamInfo, groups: list[tuple[Sequence[str], str]]) -> str | None:
    for globs, name in groups:
        if any(glob_matches(alias, g) for alias in param.aliases for g in globs):
            return name
    return None


def owned_matrices(units: list[Unit], muon: set[str], ranks: int) -> dict[str, list[OwnedMatrix]]:
    """Per unit (by name), its Muon matrices in flat order, each with its owner among
    ``ranks`` (balanced over every unit's matrices together)."""
    placed = [(u, p) for u in units if u.trainable for p in u.params if p.fqn in muon]
    owners = assign_owners({p.fqn: p.param.shape for _, p in placed}, ranks)
    out: dict[str, list[OwnedMatrix]] = {}
    for unit, p in placed:
        matrix = OwnedMatrix(p.fqn, unit.name, p.offset, tuple(p.param.shape), owners[p.fqn])
        out.setdefault(unit.name, []).append(matrix)
    return out
