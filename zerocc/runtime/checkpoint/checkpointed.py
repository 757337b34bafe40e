"""What a step shows checkpoints: its state and where it sits, its counters and its ranks.

Every step is checkpointed alike (:class:`zerocc.TrainStep`, a pipeline rank's too, which holds
only its stages' units): a checkpoint names tensors
by the model's names, so one saved under any mesh loads under any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from zerocc.compiler.capture import ModelInfo
    from zerocc.compiler.driver.session import CompileSession
    from zerocc.compiler.parallel.mesh import Mesh
    from zerocc.compiler.plan import Plan
    from zerocc.compiler.state import StateLayout
    from zerocc.compiler.units import Unit
    from zerocc.engine.comm import Comm
    from zerocc.runtime.loss_scale import LossScaler
    from zerocc.runtime.state_store import StateStore


class Checkpointed(Protocol):
    """A step as :func:`~zerocc.runtime.checkpoint.save_checkpoint` and
    :func:`~zerocc.runtime.checkpoint.load_checkpoint` see it."""

    plan: Plan  # the user's plan (the one a checkpoint records)
    comm: Comm
    device: torch.device
    model: nn.Module
    state: StateStore
    session: CompileSession  # the model as this rank holds it, its units and their layout
    loss_scaler: LossScaler | None
    steps: int  # optimizer steps applied
    micro_batches: int  # micro-batches run (calls, for a pipeline: each one step)

    @property
    def mesh(self) -> Mesh: ...

    @property
    def units(self) -> list[Unit]: ...

    @property
    def layout(self) -> StateLayout: ...

    @property
    def full_model_info(self) -> ModelInfo:
        """Every parameter and buffer of the model, whole (what a checkpoint names)."""
        ...

    @property
    def lr(self) -> float: ...

    @property
    def saved_elsewhere(self) -> frozenset[str]:
        """Parameters and buffers this rank holds that an earlier pipeline rank holds too
        and saves (a tied embedding, a buffer two stages read); empty without a pipeline."""
        ...

    def apply_carried_update(self) -> None: ...
