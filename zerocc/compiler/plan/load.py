"""Loading a plan: from a YAML file, a DeepSpeed config, a dict or a Plan, every problem one
PlanError; and the JSON Schema of plan files."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from zerocc.compiler.plan.deepspeed import is_deepspeed_config, plan_from_deepspeed, read_json
from zerocc.compiler.plan.messages import describe_error, invalid_plan, plan_origin, show
from zerocc.compiler.plan.model import Plan
from zerocc.compiler.plan.yaml_file import PlanDataError, check_shape, load_yaml
from zerocc.errors import PlanError


def load_plan(src: str | os.PathLike | dict | Plan, overrides: Sequence[str] = ()) -> Plan:
    """Load and validate a plan from a YAML file path, a dict, or a Plan (returned as is).
    A DeepSpeed config (a ``.json`` file or a dict with DeepSpeed's keys) is converted
    (:mod:`zerocc.compiler.plan.deepspeed`; an option zerocc does not support is an error).
    ``overrides``: ``KEY=VALUE`` items (``optimizer.lr=3e-4``, the command line's ``--set``),
    each setting a field by its dotted path to a YAML value, before the plan is validated.

    Raises PlanError, naming the file, the YAML path of each bad field, the value and what is
    allowed, for a missing file, bad YAML (a key given twice included), a non-mapping document,
    data nested too deep, an override that is not ``KEY=VALUE``, or an invalid field.
    """
    where = "plan"
    source = None
    if isinstance(src, Plan):
        if not overrides:
            return src
        src, source = src.model_dump(mode="json", exclude_defaults=True), src.source
    if isinstance(src, dict):
        data: Any = src
    elif isinstance(src, str | os.PathLike):
        source = str(Path(os.fsdecode(src)))
        where = plan_origin(source)
        if "\0" in source:
            raise PlanError(f"{where}: a path cannot contain a NUL byte")
        path = Path(source)
        data = read_json(path, where) if path.suffix == ".json" else _read_yaml(path, where)
    else:
        raise PlanError(f"a plan is a YAML path, a dict or a zerocc.Plan, not {type(src).__name__}")
    try:
        check_shape(data)
    except PlanDataError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if not isinstance(data, dict):
        got = f"{type(data).__name__} {show(data)}"
        raise PlanError(f"{where}: expected a mapping of fields at the top, got {got}")
    if is_deepspeed_config(data):  # a ds_config.json: converted, every key accounted for
        data, _ = plan_from_deepspeed(data, where)
    if overrides:
        data = with_overrides(data, overrides)
        where += " with " + " ".join(f"--set {item}" for item in overrides)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise invalid_plan(where, [describe_error(err, Plan) for err in exc.errors()]) from None
    plan._source = source
    return plan


def with_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of the plan data ``data`` with each ``KEY=VALUE`` of ``overrides`` set: the key a
    dotted path (its sections made where missing), the value read as YAML (``3e-4``, ``true``,
    ``[Block]``, ``{stage: 3}``); PlanError for an item without ``=`` or an empty key, or a
    path through a field that holds no section."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            raise PlanError(
                f"--set {item}: expected KEY=VALUE, a field by its dotted path and its value "
                "(e.g. --set optimizer.lr=3e-4)"
            )
        try:
            value = load_yaml(text) if text.strip() else None
        except (yaml.YAMLError, PlanDataError) as exc:
            raise PlanError(f"--set {item}: the value is not YAML: {exc}") from None
        section = data
        for i, name in enumerate(path[:-1]):
            section = section.setdefault(name, {})
            if not isinstance(section, dict):
                within = ".".join(path[: i + 1])
                raise PlanError(f"--set {item}: {within} is {show(section)}, not a section")
        section[path[-1]] = value
    return data


def _read_yaml(path: Path, where: str) -> Any:
    """The document of the plan file at ``path`` ({} for an empty file)."""
    if not path.is_file():
        raise PlanError(f"{where}: not found" if not path.exists() else f"{where}: not a file")
    try:
        with path.open() as stream:  # a stream, so YAML errors name the file
            data = load_yaml(stream)
    except PlanDataError as exc:
        raise PlanError(f"{where}: invalid YAML: {exc}") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{where}: invalid YAML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{where}: cannot be read: {exc}") from None
    return {} if data is None else data  # an empty file: every default


def plan_json_schema() -> dict:
    """The JSON Schema of plan files, for editors and `zerocc plan schema`."""
    schema = Plan.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
