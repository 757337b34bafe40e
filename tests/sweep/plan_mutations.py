"""Plans for the plan fuzz (tests/sweep/test_plan_fuzz.py): the shipped examples' plans, each
with a few fields set to values drawn from a seeded generator: wrong types, numbers out of
range (huge, tiny, negative, inf, nan), quoted numbers, long strings, odd paths, unknown keys,
and the allowed values of every field of every section of the current schema (so that some
plans are accepted and reach what validation does across sections).

A mutation is a ``--set KEY=VALUE`` item (the value as YAML), the form the command line sets
a field in: the fuzzed plan is the example file with those items, checked by
``zerocc plan check``'s own code (:func:`zerocc.cli.plan.checked_plan`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerocc.compiler.plan import plan_json_schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(
    str(path.relative_to(ROOT))
    for folder in ("examples/gpt", "examples/huggingface", "examples/torchrun")
    for path in (ROOT / folder).glob("*.yaml")
)


@dataclass(frozen=True)
class Field:
    """A leaf of the plan schema: its dotted path, JSON types and allowed choices."""

    path: str
    types: tuple[str, ...]
    choices: tuple[Any, ...]
    bounds: tuple[float | None, float | None]


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return schema["$defs"][ref.rsplit("/", 1)[1]] if ref else node


def _fields(schema: dict[str, Any], node: dict[str, Any], path: str) -> list[Field]:
    """The leaves under ``node`` (sections recursed into, ``anyOf`` branches merged)."""
    node = _resolve(schema, node)
    if "properties" in node:
        return [
            leaf
            for name, child in node["properties"].items()
            for leaf in _fields(schema, child, f"{path}.{name}" if path else name)
        ]
    branches = [_resolve(schema, b) for b in node.get("anyOf", [node])]
    if any("properties" in b for b in branches):  # an optional section (optimizer.schedule)
        section = next(b for b in branches if "properties" in b)
        return _fields(schema, section, path) + [Field(path, ("null",), (None,), (None, None))]
    types = tuple(str(b.get("type", "object")) for b in branches)
    choices = tuple(c for b in branches for c in b.get("enum", [b.get("const")] * ("const" in b)))
    return [Field(path, types, choices, (_bound(branches, "minimum"), _bound(branches, "maximum")))]


def _bound(branches: list[dict[str, Any]], which: str) -> float | None:
    """The first branch's ``minimum`` (or ``maximum``), inclusive or exclusive."""
    exclusive = "exclusive" + which.capitalize()
    return next((b.get(which, b.get(exclusive)) for b in branches if which in b or exclusive in b),
                None)  # fmt: skip


# The example GPT workload's arguments (checked when the workload is called: spot training)
WORKLOAD_ARGS = [
    Field(f"workload_args.{name}", ("integer",), (), (1, 64))
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size")
]


def schema_fields() -> list[Field]:
    """Every leaf field of the current plan schema, every section's, and the example GPT
    workload's arguments."""
    schema = plan_json_schema()
    return _fields(schema, schema, "") + WORKLOAD_ARGS


LONG = "x" * 300
ODD_STRINGS = ["", " ", LONG, "y" * 10_000, "/proc/self", "/dev/null", "/", "~", "../../..",
               "/nonexistent/deep/path", "a\tb", "é☃", "${HOME}", "*", "[", "null", "1e3",
               "-0", "0x10", "True", "'quoted'", "C:\\\\windows", "a\0b",
               "w" * 300 + ":workload", "a." * 150 + "b:f", "workload:" + "f" * 300,
               "examples/gpt/model.py:GPT", "workload:workload"]  # fmt: skip
ODD_NUMBERS = [0, -1, 1, 2, 3, 7, -0.0, 1e-9, 1e-300, 5e-324, 1e300, -1e300, 1e308, 2**31,
               2**63, 2**64, -(2**63), 10**30, 0.5, 1.5, math.inf, -math.inf, math.nan]  # fmt: skip
ODD_VALUES = [None, True, False, [], [1], {}, {"a": 1}, [[[]]], {"stage": 3}]


def yaml_value(value: Any) -> str:
    """``value`` as YAML text (JSON is YAML; inf and nan as YAML writes them)."""
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    return json.dumps(value)


def _value_for(rng: random.Random, field: Field) -> str:
    """A value for ``field``: one it allows (half the time where it has choices or bounds),
    else an odd one of any kind."""
    kind = rng.random()
    if field.choices and kind < 0.5:
        return yaml_value(rng.choice(field.choices))
    low, high = field.bounds
    if kind < 0.45 and ("integer" in field.types or "number" in field.types):
        lo, hi = low if low is not None else -10, high if high is not None else 10
        lo, hi = max(lo, -1e6), min(hi, 1e6)
        for edge in (lo, hi):  # just inside, at, and just outside each bound
            if rng.random() < 0.3:
                step = rng.choice([-1, 0, 1])
                value = edge + step if "integer" in field.types else edge * (1 + 1e-9 * step)
                return yaml_value(int(value) if "integer" in field.types else value)
        number = rng.uniform(lo, hi)
        return yaml_value(round(number) if "integer" in field.types else number)
    if "string" in field.types and not field.choices and kind < 0.6:
        return yaml_value(rng.choice(ODD_STRINGS))  # (paths and names: the odd strings)
    if kind < 0.6:
        number = rng.choice(ODD_NUMBERS)
        return f'"{number}"' if rng.random() < 0.2 else yaml_value(number)  # quoted: a string
    if kind < 0.8:
        return yaml_value(rng.choice(ODD_STRINGS))
    return yaml_value(rng.choice(ODD_VALUES))


def mutations(rng: random.Random, fields: list[Field]) -> list[str]:
    """One to three ``KEY=VALUE`` items: fields set to drawn values, now and then an unknown
    key (at the top or in a section) or a section replaced by a scalar."""
    items = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        roll = rng.random()
        field = rng.choice(fields)
        if roll < 0.05:
            section = field.path.rsplit(".", 1)[0] if "." in field.path else ""
            items.append(f"{section + '.' if section else ''}no_such_field_{rng.randrange(9)}=1")
        elif roll < 0.08 and "." in field.path:
            items.append(f"{field.path.split('.')[0]}={rng.choice(['3', 'null', '[1, 2]', 'x'])}")
        else:
            items.append(f"{field.path}={_value_for(rng, field)}")
    return items


@dataclass(frozen=True)
class FuzzPlan:
    """A fuzzed plan: an example file and the items set in it."""

    example: str
    items: tuple[str, ...]

    def __str__(self) -> str:
        return " ".join([self.example, *(f"--set {item}" for item in self.items)])


def fuzzed_plans(count: int, seed: int = 0) -> list[FuzzPlan]:
    """``count`` fuzzed plans, the same for the same ``seed``: every leaf of every section is
    the target of some of them (the fields cycled through, each plan's example drawn)."""
    rng = random.Random(seed)
    fields = schema_fields()
    plans = []
    for i in range(count):
        first = fields[i % len(fields)]  # every field, round after round
        items = [f"{first.path}={_value_for(rng, first)}", *mutations(rng, fields)[1:]]
        plans.append(FuzzPlan(rng.choice(EXAMPLES), tuple(items)))
    return plans
