"""How far a rank's training has come: micro-batches run and optimizer steps applied."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCounts:
    """The step runner's counters, apart from the runner so that what reads them (the rank's
    health, for the step its errors name) holds no reference to the runner itself."""

    grad_accumulation: int  # micro-batches to an optimizer step
    micro_batches: int = 0  # run (a checkpoint's included)
    steps: int = 0  # optimizer steps applied (steps skipped for overflow not counted)

    @property
    def step_number(self) -> int:
        """The 1-based number of the optimizer step the next micro-batch belongs to."""
        return self.micro_batches // self.grad_accumulation + 1
