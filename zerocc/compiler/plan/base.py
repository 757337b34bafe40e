"""What every section of the plan shares: the base model (unknown fields are errors, numbers
are finite and never booleans or quoted strings), path fields, and the smallest fp32 number a
plan may give."""

from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)

# The smallest positive normal fp32 number: a positive value below it (eps, a loss scale) is a
# subnormal or rounds to 0 in the fp32 arithmetic of the update and the loss scaling.
FP32_TINY = 2.0**-126  # float32's smallest normal number (torch.finfo(torch.float32).tiny)
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
    number is never a YAML boolean (``lr: true`` would read as 1.0) nor a string (``lr: "1e-3"``,
    quoted: pydantic would read it as 0.001 where the plan's author wrote text, and a JSON
    schema or another tool reads it as text)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _takes_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{value!r} is a boolean, not a number")
        if _takes_numbers(cls.model_fields[info.field_name].annotation):
            refuse_quoted_numbers(value)
        return value


def refuse_quoted_numbers(value: Any) -> None:
    """ValueError when ``value`` is, or holds, a number written as a string (``"1e-3"``)."""
    quoted = _quoted_number(value)
    if quoted is not None:
        raise ValueError(
            f"{quoted!r} is a string (quoted), not a number; write the number without quotes: "
            f"{quoted.strip()}"
        )


def _quoted_number(value: Any) -> str | None:
    """The first string in ``value`` (itself, or an item of its list or mapping) that reads as
    a number, else None; strings that are no number (a Literal's ``auto``) are left to the
    field's own type."""
    items = value.values() if isinstance(value, dict) else value
    for item in items if isinstance(value, list | tuple | dict) else (value,):
        if isinstance(item, str):
            try:
                float(item)
            except ValueError:
                continue
            return item
    return None


def _takes_numbers(annotation: Any) -> bool:
    """Whether a field's type admits plain numbers (int or float, alone or in a union)."""
    if annotation in (int, float):
        return True
    return any(_takes_numbers(arg) for arg in typing.get_args(annotation))
