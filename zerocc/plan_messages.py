"""Error messages for invalid plans: one line per bad field, naming its YAML path, the value
and what is allowed there (with a close match for a misspelled field name)."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import ErrorDetails


def describe_error(err: ErrorDetails, root: type[BaseModel]) -> str:
    """One line for one pydantic error of model ``root``: YAML path, what is wrong, the value,
    what is allowed."""
    loc = err["loc"]
    path = _dotted(loc) or "<plan>"
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = list(_model_at(root, loc[:-1]).model_fields)
        name = str(loc[-1])
        close = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{path}: unknown field {name!r}{hint}; allowed fields here: {', '.join(allowed)}"
    if kind == "literal_error":
        choices = _literal_choices(root, loc) or [err.get("ctx", {}).get("expected", "?")]
        return f"{path}: {show(value)} is not allowed; allowed values: {', '.join(choices)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        model = _model_at(root, loc)
        expected = f"fields: {', '.join(model.model_fields)}" if model else "keys and values"
        return f"{path}: expected a mapping of {expected}; got {show(value)}"
    msg = err["msg"]
    if kind in ("value_error", "assertion_error"):
        return f"{path}: {msg.split(', ', 1)[-1]}"
    return f"{path}: {msg[:1].lower()}{msg[1:]}; got {show(value)}"


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model found by following `loc` from `root`, or None if it leads elsewhere."""
    model: type[BaseModel] | None = root
    for part in loc:
        field = model.model_fields.get(part) if model and isinstance(part, str) else None
        nested = field.annotation if field else None
        model = nested if isinstance(nested, type) and issubclass(nested, BaseModel) else None
    return model


def _literal_choices(root: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    model = _model_at(root, loc[:-1])
    field = model.model_fields.get(str(loc[-1])) if model else None
    if field is None or typing.get_origin(field.annotation) is not Literal:
        return []
    return [show(choice) for choice in typing.get_args(field.annotation)]


def show(value: Any) -> str:
    """A value as an error message quotes it, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
