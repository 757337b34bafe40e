"""The loss scale of fp16 training: backed off when gradients overflow, grown when they do not.

The program seeds backward with the scale (a state tensor), unscales the reduced gradients and
returns whether any overflowed on any rank; the update of such a step writes nothing. After
each optimizer step the TrainStep reports the flag here, and the next step runs with the new
scale. The rule is DeepSpeed's dynamic loss scaler, which with ``hysteresis: 1`` is exactly
``torch.amp.GradScaler``'s: on overflow the step is skipped and, once ``hysteresis`` overflows
have been tolerated, the scale is multiplied by ``backoff_factor`` (never below ``min_scale``);
after ``growth_interval`` steps in a row without overflow it is multiplied by
``growth_factor`` (and the hysteresis budget refilled), never above ``MAX_LOSS_SCALE`` (2^32,
the plan's own bound: a scale left to grow reaches inf, and then every step is skipped). A
static scale never changes, but its overflowing steps are still skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerocc.compiler.plan import MAX_LOSS_SCALE, PrecisionConfig


@dataclass
class LossScaler:
    """The scale, its counters, and the tensor the programs read it from."""

    tensor: torch.Tensor  # the 0-dim fp32 state tensor backward is seeded with
    dynamic: bool
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    hysteresis: int
    min_scale: float
    scale: float = 1.0
    good_steps: int = 0  # optimizer steps since the last overflow or growth
    hysteresis_left: int = 1
    skipped_steps: int = 0

    @classmethod
    def of(cls, precision: PrecisionConfig, tensor: torch.Tensor) -> LossScaler:
        """The scaler a plan asks for (``precision.scaling`` must not be 'none')."""
        knobs = precision.dynamic
        dynamic = precision.scaling == "dynamic"
        scaler = cls(
            tensor,
            dynamic,
            knobs.growth_interval,
            knobs.growth_factor,
            knobs.backoff_factor,
            knobs.hysteresis,
            knobs.min_scale,
            scale=knobs.initial if dynamic else float(precision.loss_scale),
            hysteresis_left=knobs.hysteresis,
        )
        scaler.tensor.fill_(scaler.scale)
        return scaler

    def update(self, overflow: bool) -> None:
        """Account one optimizer step; ``overflow``: it was skipped for an inf/NaN gradient."""
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                if self.hysteresis_left > 1:
                    self.hysteresis_left -= 1
                else:
                    self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        elif self.dynamic:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale = min(self.scale * self.growth_factor, MAX_LOSS_SCALE)
                self.good_steps = 0
                self.hysteresis_left = self.hysteresis
        self.tensor.fill_(self.scale)

    def state_dict(self) -> dict[str, float | int]:
        """The scale and counters, to save with the optimizer state."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
        self.tensor.fill_(self.scale)
