"""What every section of the plan shares: the base model (unknown fields are errors, numbers
are finite and never booleans), path fields, and the smallest fp32 number a plan may give."""

from __future__ import annotations

import typing
from typing import Annotated, Any

import torch
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)

# The smallest positive normal fp32 number: a positive value below it (eps, a loss scale) is a
# subnormal or rounds to 0 in the fp32 arithmetic of the update and the loss scaling.
FP32_TINY = torch.finfo(torch.float32).tiny
MAX_MB = 1e9  # a size in MB no device or bucket reaches (a petabyte)


def _no_nul(path: str | None) -> str | None:
    """A path field: no file system allows a NUL byte in a path (open() would raise)."""
    if path is not None and "\0" in path:
        raise ValueError(f"{path!r} contains a NUL byte, which no file system allows in a path")
    return path


PathStr = Annotated[str, AfterValidator(_no_nul)]


class Section(BaseModel):
    """Base of every plan model: an unknown field (a typo) is an error, not a silent default;
    every float is finite (YAML's .inf and .nan are not numbers a plan can train with), and a
    number is never a YAML boolean (``lr: true`` would read as 1.0)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _takes_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{value!r} is a boolean, not a number")
        return value


def _takes_numbers(annotation: Any) -> bool:
    """Whether a field's type admits plain numbers (int or float, alone or in a union)."""
    if annotation in (int, float):
        return True
    return any(_takes_numbers(arg) for arg in typing.get_args(annotation))
