"""``training_step`` as a zerocc loss function, and its ``self.log`` calls replayed each step.

The step captures ``training_step`` once; what it logs is seen then, while the values are the
trace's. So ``self.log`` is recorded during the capture instead of logged, and after each step
call the records are logged again with that step's values: the loss ``training_step`` returned
(the step's loss) and the learning rate read from ``self.optimizers()`` or
``self.lr_schedulers()`` (the optimizer's rate now, which its scheduler moves as Lightning
steps it). Any other value was computed once, at the capture, and would be logged stale each
step: it is refused by name (:class:`~zerocc.errors.NotSupportedError`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerocc.errors import NotSupportedError


class TracedRate(float):
    """A learning rate as ``training_step`` reads it during the capture, which knows how to
    read the rate again at each step."""

    read: Callable[[], float]

    def __new__(cls, value: float, read: Callable[[], float]) -> TracedRate:  # noqa: D102
        rate = super().__new__(cls, value)
        rate.read = read
        return rate


@dataclass
class LogRecord:
    """One ``self.log(name, value, **options)`` of ``training_step``, and which value it is:
    ``"loss"`` (the returned loss) or ``"lr"`` (a rate, re-read by ``read``)."""

    name: str
    kind: str
    options: dict[str, Any]
    read: Callable[[], float] | None = None


@contextmanager
def _rates_traced(optimizer: torch.optim.Optimizer, schedulers: list) -> Iterator[None]:
    """The optimizer's rates (and its schedulers' last rates) as :class:`TracedRate` while
    ``training_step`` is captured."""
    groups = optimizer.param_groups
    kept = [g["lr"] for g in groups]
    last = [getattr(c.scheduler, "_last_lr", None) for c in schedulers]
    try:
        for index, group in enumerate(groups):
            group["lr"] = TracedRate(group["lr"], lambda i=index: float(groups[i]["lr"]))
        for config in schedulers:
            if getattr(config.scheduler, "_last_lr", None) is not None:
                config.scheduler._last_lr = [
                    TracedRate(v, lambda i=i: float(groups[i]["lr"]))
                    for i, v in enumerate(config.scheduler._last_lr)
                ]
        yield
    finally:
        for group, lr in zip(groups, kept, strict=True):
            group["lr"] = lr
        for config, rates in zip(schedulers, last, strict=True):
            if rates is not None:
                config.scheduler._last_lr = rates


@dataclass
class LoggedInStep:
    """The loss function zerocc compiles (``training_step``'s loss) and the ``self.log`` calls
    it made, replayed after each step call."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    schedulers: list
    batch_idx: int = 0
    structure: Any = None  # how the batch was given: "tensor", its sequence type, or "mapping"
    records: list[LogRecord] = field(default_factory=list)
    _traced: tuple[list, Any] | None = None

    def step_inputs(self, batch: Any, batch_idx: int) -> tuple[tuple, dict[str, Any]]:
        """The step's arguments for a Lightning batch (a tensor, a tuple or list of them, or a
        mapping by name), and what the loss function rebuilds the batch as."""
        self.batch_idx = batch_idx
        if isinstance(batch, Mapping):
            self.structure = "mapping"
            return (), dict(batch)
        if isinstance(batch, (tuple, list)):
            self.structure = type(batch)
            return tuple(batch), {}
        self.structure = "tensor"
        return (batch,), {}

    def _batch(self, parts: tuple, named: dict[str, Any]) -> Any:
        if self.structure == "mapping":
            return named
        if self.structure == "tensor":
            return parts[0]
        return self.structure(parts)

    def loss_fn(self, model: nn.Module, *parts: Any, **named: Any) -> torch.Tensor:
        """``training_step(batch, batch_idx)``'s loss, its ``self.log`` calls recorded."""
        seen: list[tuple[str, Any, dict[str, Any]]] = []

        def log(name: str, value: Any, *args: Any, **options: Any) -> None:
            if args:
                raise NotSupportedError(
                    f"self.log({name!r}, ...) in training_step: give its options by name "
                    "(prog_bar=True, ...) under ZeroccStrategy"
                )
            seen.append((name, value, options))

        model.__dict__["log"] = log  # log_dict calls self.log too
        try:
            with _rates_traced(self.optimizer, self.schedulers):
                out = model.training_step(self._batch(parts, named), self.batch_idx)
        finally:
            del model.__dict__["log"]
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise NotSupportedError(
                f"training_step returned {type(out).__name__}; under ZeroccStrategy it returns "
                "the loss (a tensor, or a dict with 'loss'): a step cannot be skipped"
            )
        self._traced = (seen, loss)
        return loss

    def replay(self, module: nn.Module, loss: torch.Tensor) -> None:
        """Log what ``training_step`` logged, with this step's loss and rates (after the
        capture, its records are read first: a value the step cannot give is refused)."""
        if self._traced is not None:
            seen, traced_loss = self._traced
            self._traced = None
            self.records = [_record(name, value, options, traced_loss)
                            for name, value, options in seen]  # fmt: skip
        for record in self.records:
            if record.kind == "loss":
                module.log(record.name, loss.detach(), **record.options)
            else:
                assert record.read is not None
                module.log(record.name, record.read(), **record.options)


def _record(name: str, value: Any, options: dict[str, Any], loss: Any) -> LogRecord:
    """What a logged value is: the returned loss, a rate, or refused."""
    if value is loss:
        return LogRecord(name, "loss", options)
    if isinstance(value, TracedRate):
        return LogRecord(name, "lr", options, value.read)
    what = "a tensor computed in the step" if isinstance(value, torch.Tensor) else repr(value)
    raise NotSupportedError(
        f"self.log({name!r}, ...) in training_step logs {what}, not the loss it returns nor "
        "the learning rate: the step is captured once and returns its loss only, so the value "
        "would be the capture's at every step; log the returned loss, the rate "
        "(self.optimizers().param_groups[0]['lr']), or log it in validation_step or a callback"
    )
