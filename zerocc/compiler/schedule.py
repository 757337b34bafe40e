"""The learning rate of each optimizer step under a plan's ``optimizer.schedule``.

``lr_at(optimizer, steps)`` is the rate of the step that follows ``steps`` applied steps, in
Python floats, as the schedulers it matches compute it:

- ``constant``, ``linear``, ``cosine``: Hugging Face Trainer's ``constant_with_warmup``,
  ``linear`` and ``cosine`` (``get_*_schedule_with_warmup``), as multipliers of ``lr`` applied
  by ``torch.optim.lr_scheduler.LambdaLR``; ``min_lr`` lifts the floor of the decay (Trainer's
  ``cosine_with_min_lr``).
- ``warmup_lr``, ``warmup_decay_lr``, ``warmup_cosine_lr``: DeepSpeed's schedulers, stepped
  after every applied optimizer step by its engine. DeepSpeed's first step runs at the rate of
  ``last_batch_iteration = -1`` (the start of warmup), its second at iteration 0 (the start
  again: log(1) = 0), so step ``n`` here is DeepSpeed's iteration ``n - 1``.
"""

from __future__ import annotations

import math

from zerocc.compiler.plan import OptimizerConfig, ScheduleConfig


def lr_at(optimizer: OptimizerConfig, steps: int) -> float:
    """The learning rate of the optimizer step after ``steps`` applied steps (0: the first)."""
    schedule = optimizer.schedule
    if schedule.name in ("constant", "linear", "cosine"):
        return _trainer_lr(schedule, optimizer.lr, steps)
    return _deepspeed_lr(schedule, optimizer.lr, steps - 1)


def _trainer_lr(schedule: ScheduleConfig, lr: float, step: int) -> float:
    """Trainer's multiplier of ``lr`` at ``step``, computed as Trainer computes it (so the
    rates are the same floats); the decay is held at its end after ``total_steps``."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return lr * (step / max(1, warmup))
    if schedule.name == "constant":
        return lr
    total = schedule.total_steps
    if schedule.name == "linear":
        factor = max(0.0, (total - step) / max(1, total - warmup))
    else:
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = schedule.min_lr / lr
    return lr * (factor * (1 - floor) + floor)


def _deepspeed_lr(schedule: ScheduleConfig, lr: float, iteration: int) -> float:
    """DeepSpeed's scheduler's rate after ``iteration + 1`` calls of its ``step()``."""
    warmup = max(2, schedule.warmup_num_steps)  # as DeepSpeed: log(1) would divide by 0
    if schedule.name == "warmup_cosine_lr":
        return lr * _cosine_ratio(schedule, warmup, iteration)
    low, high = schedule.warmup_min_lr, schedule.warmup_max_lr or lr
    if iteration < 0:
        return low
    if iteration < warmup:
        gamma = _warmup_fraction(schedule, warmup, iteration)
    elif schedule.name == "warmup_lr":
        gamma = 1.0
    else:  # warmup_decay_lr
        total = schedule.total_num_steps
        gamma = max(0.0, (total - iteration) / max(1.0, total - warmup))
    return low + (high - low) * gamma


def _cosine_ratio(schedule: ScheduleConfig, warmup: int, iteration: int) -> float:
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        fraction = _warmup_fraction(schedule, warmup, iteration)
        return schedule.warmup_min_ratio + fraction * (1.0 - schedule.warmup_min_ratio)
    progress = min(1.0, (iteration - warmup + 1) / max(1, schedule.total_num_steps - warmup))
    ratio = (1 + math.cos(math.pi * progress)) / 2
    return max(0.0, schedule.cos_min_ratio + (1.0 - schedule.cos_min_ratio) * ratio)


def _warmup_fraction(schedule: ScheduleConfig, warmup: int, iteration: int) -> float:
    if schedule.warmup_type == "log":
        return (1.0 / math.log(warmup)) * math.log(iteration + 1)
    return iteration / warmup
