"""Error messages for invalid plans: one line per bad field, naming its YAML path, the value
and what is allowed there (with a close match for a misspelled field name)."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from zerocc.errors import PlanError


def plan_origin(source: str | None) -> str:
    """How messages name a plan: 'plan file PATH' (the path quoted when it holds characters a
    terminal would not print), or 'plan' for one given as a dict."""
    if source is None:
        return "plan"
    return f"plan file {source if source.isprintable() else repr(source)}"


def invalid_plan(where: str, lines: list[str]) -> PlanError:
    """The PlanError for the problems ``lines`` (one per bad field) of the plan ``where``: one
    line for one problem, a list under a heading for several."""
    if len(lines) == 1:
        return PlanError(f"{where}: {lines[0]}")
    return PlanError(f"{where} is invalid:\n" + "\n".join(f"  {line}" for line in lines))


def describe_error(err: ErrorDetails, root: type[BaseModel]) -> str:
    """One line for one pydantic error of model ``root``: YAML path, what is wrong, the value,
    what is allowed."""
    loc = err["loc"]
    path = dotted(loc) or "<plan>"  # a check across sections (loc ()) names its fields itself
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
    if kind in _NUMBER_ERRORS:
        noun, bounds = _number_range(root, loc)
        allowed = _range_text(bounds or err.get("ctx", {}).items())
        return f"{path}: {show(value)} is not allowed; allowed: {noun}{allowed}"
    msg = err["msg"]
    if kind in ("value_error", "assertion_error"):
        text = msg.split(", ", 1)[-1]
        return f"{path}: {text}" if loc else text
    return f"{path}: {msg[:1].lower()}{msg[1:]}; got {show(value)}"


# pydantic's errors of a number out of its range (or not finite): the message gives the range.
_NUMBER_ERRORS = {
    "finite_number", "greater_than", "greater_than_equal", "less_than", "less_than_equal",
}  # fmt: skip
_BOUND_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _number_range(
    root: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[str, list[tuple[str, Any]]]:
    """What the number at ``loc`` (a field, or an item of a tuple field) is ('an integer' or 'a
    finite number') and the bounds declared on it, e.g. [('ge', 0), ('lt', 1)]."""
    model = _model_at(root, loc[:-1])
    field = model.model_fields.get(str(loc[-1])) if model else None
    metadata = list(field.metadata) if field else []
    if field is None and len(loc) > 1 and isinstance(loc[-1], int):  # e.g. optimizer.betas[1]
        model = _model_at(root, loc[:-2])
        outer = model.model_fields.get(str(loc[-2])) if model else None
        items = typing.get_args(outer.annotation) if outer else ()
        item = items[loc[-1]] if loc[-1] < len(items) else None
        for extra in getattr(item, "__metadata__", ()):
            metadata += getattr(extra, "metadata", [extra])
    bounds = [
        (name, getattr(m, name)) for m in metadata for name in _BOUND_SIGNS if hasattr(m, name)
    ]
    integer = field is not None and int in (field.annotation, *typing.get_args(field.annotation))
    return ("an integer" if integer else "a finite number"), bounds


def _range_text(bounds: typing.Iterable[tuple[str, Any]]) -> str:
    """' >= 0 and < 1' for [('ge', 0), ('lt', 1)] ('' for none)."""
    parts = [
        f"{_BOUND_SIGNS[name]} {_number(bound)}" for name, bound in bounds if name in _BOUND_SIGNS
    ]
    return f" {' and '.join(parts)}" if parts else ""


def _number(value: float) -> str:
    """A bound as a message writes it: whole numbers in full (2^32 as 4294967296)."""
    exact = float(value).is_integer() and abs(value) < 1e16
    return str(int(value)) if exact else f"{value:.3g}"


def dotted(loc: tuple[int | str, ...]) -> str:
    """A location as YAML paths are written: ``optimizer.betas[1]``."""
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
