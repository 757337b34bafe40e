"""A batch as a step takes it: positional values (``step(x, y)``), values by name as Hugging Face
models take them (``step(input_ids=ids, labels=ids)``), or one mapping of them (``step(batch)``,
a dict or a tokenizer's ``BatchEncoding``).

Inside zerocc a batch is always a tuple: a named one begins with a :class:`Keywords` marker
that names the values after its positional ones. The marker is a value like any non-tensor
entry: it is part of the batch's signature (other names compile another program), given to
every micro-batch, agreed between ranks; and the step calls the model (or the loss function)
with the named values as keywords (:func:`call_arguments`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerocc.errors import BatchError


@dataclass(frozen=True)
class Keywords:
    """The first entry of a batch given by name: ``positional`` values follow it, then one
    value per name in ``names``."""

    names: tuple[str, ...]
    positional: int = 0

    def __repr__(self) -> str:  # (in signatures and error messages)
        return f"keywords({', '.join(self.names)})"


def batch_from(args: tuple, named: Mapping[str, Any]) -> tuple:
    """The batch tuple of a step's call ``step(*args, **named)``: ``args`` as they are when
    nothing is named; one mapping alone (``step(batch_dict)``) is taken as its values by name.
    BatchError for a mapping whose keys are not strings, or a mapping beside other values."""
    if not named and len(args) == 1 and isinstance(args[0], Mapping):
        args, named = (), args[0]
    if not named:
        if any(isinstance(a, Mapping) for a in args):
            raise BatchError(
                "a batch is tensors (step(x, y)), tensors by name (step(input_ids=ids, "
                "labels=ids)) or one mapping of them (step(batch)); a mapping beside other "
                "values is none of these"
            )
        return args
    names = tuple(named)
    bad = [repr(n) for n in names if not isinstance(n, str)]
    if bad:
        raise BatchError(f"a batch's names must be strings (the model's arguments), got {bad}")
    return (Keywords(names, len(args)), *args, *named.values())


def call_arguments(batch: tuple) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments ``batch`` calls the model (or loss function) with."""
    if not batch or not isinstance(batch[0], Keywords):
        return batch, {}
    marker, values = batch[0], batch[1:]
    positional = values[: marker.positional]
    return positional, dict(zip(marker.names, values[marker.positional :], strict=True))


def as_batch(value: Any) -> tuple:
    """A workload's batch as a step's call takes it: a tuple (or list) of values as it is, one
    mapping of them by name (a tokenizer's output) as :func:`batch_from` makes it."""
    return batch_from((value,), {}) if isinstance(value, Mapping) else tuple(value)
