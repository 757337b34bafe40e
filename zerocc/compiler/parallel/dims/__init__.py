"""The parallel dimensions, one module each, registered here in the order their groups are
made (every rank creates them in this order): data parallelism and hybrid sharding
(:mod:`.data`), tensor parallelism (:mod:`.tensor`), pipeline stages (:mod:`.pipeline`),
expert parallelism (:mod:`.expert`), ZeRO++'s secondary partition (:mod:`.secondary`). What a
dimension is: :mod:`.base`; the mesh that composes them: :mod:`zerocc.compiler.parallel.mesh`.
docs/design-notes.md ("Parallel dimensions") says what adding one touches."""

from __future__ import annotations

from zerocc.compiler.parallel.dims.base import Dimension, Group, MeshLayout, Spread
from zerocc.compiler.parallel.dims.data import DATA
from zerocc.compiler.parallel.dims.expert import EXPERT
from zerocc.compiler.parallel.dims.pipeline import PIPELINE
from zerocc.compiler.parallel.dims.secondary import SECONDARY_PARTITION
from zerocc.compiler.parallel.dims.tensor import TENSOR

DIMENSIONS: tuple[Dimension, ...] = (DATA, TENSOR, PIPELINE, EXPERT, SECONDARY_PARTITION)

__all__ = ["DIMENSIONS", "Dimension", "Group", "MeshLayout", "Spread"]
