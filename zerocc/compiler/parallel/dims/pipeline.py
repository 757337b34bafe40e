"""Pipeline parallelism (``parallel.pp``): the model cut into stages, the ranks into ``pp``
blocks of ``stage_ranks`` (outermost: a stage's activations cross between blocks once per
micro-batch), chained over the ``pp`` groups (the ranks of one pipeline, one of each block);
``tie``: a pipeline's first and last ranks (a tied embedding and head). How the step is cut
and scheduled: :mod:`zerocc.compiler.parallel.stage_cut`,
:mod:`zerocc.compiler.parallel.pipeline_schedule`.

    rank = pp_rank × stage_ranks + (rank within the stage)
"""

from __future__ import annotations

from zerocc.compiler.parallel.dims.base import (
    Dimension,
    Group,
    MeshLayout,
    Ranks,
    RanksOf,
    Spread,
    some,
)
from zerocc.ir.ops import PP_GROUP as PP
from zerocc.ir.ops import TIE_GROUP as TIE


def _pipelines(m: MeshLayout) -> Ranks:
    n = m.stage_ranks
    return [list(range(i, m.world_size, n)) for i in range(n)]


def _ends(m: MeshLayout) -> Ranks:
    return [[ranks[0], ranks[-1]] for ranks in _pipelines(m)]


def _index(m: MeshLayout, sizes: list[str], index: str) -> tuple[list[str], str]:
    if m.pp == 1:
        return sizes, index
    return [f"{m.pp} pipeline stages' ranks", *sizes], f"pp × {m.stage_ranks} + {index}"


def _said(m: MeshLayout, groups: RanksOf) -> list[str]:
    return [f"stages chained over the pp groups {some(groups(PP))}"] if m.pp > 1 else []


def _spread(m: MeshLayout, group: str, sharded: bool) -> Spread | None:
    # The other pipeline ranks hold the other stages' units.
    return Spread(PP, "units", "the pipeline's stages") if m.pp > 1 else None


PIPELINE = Dimension(
    name="pipeline",
    degree="pp",
    field="parallel.pp",
    groups=(
        Group(PP, lambda m: m.pp > 1, _pipelines, whole_world=True),
        Group(TIE, lambda m: m.pp > 1, _ends, whole_world=True),
    ),
    said=_said,
    said_at=4,
    index=_index,
    spread=_spread,
)
