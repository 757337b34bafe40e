"""Reading a plan's data strictly, before pydantic sees it.

YAML's own loader lets the last of two equal keys win, recurses once per level of nesting (so a
document nested a few thousand levels deep ends in a RecursionError), and builds aliases into
shared or cyclic objects that anything walking the plan later (an error message's repr, the
dumps' YAML) would expand or never finish. Here a key given twice is an error naming it and its
lines, and documents nested deeper than ``MAX_NESTING`` levels or holding more than
``MAX_VALUES`` values (aliases expanded) are refused with a one-line message.
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml
from yaml.nodes import MappingNode, Node

from zerocc.compiler.plan.messages import dotted

# Levels of mappings and lists in a plan: the sections use 3, workload_args a few more.
MAX_NESTING = 100
# Values in a plan once YAML aliases are expanded (a "billion laughs" document is 10^9).
MAX_VALUES = 1_000_000

_MERGE_TAG = "tag:yaml.org,2002:merge"


class PlanDataError(ValueError):
    """A plan's data that no plan may hold: a duplicate key, too deep, too many values. The
    message is one line."""


class _PlanLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with duplicate keys refused and the nesting bounded while the
    document is composed (the composer is the part that recurses per level)."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self._depth >= MAX_NESTING:
            line = self.peek_event().start_mark.line + 1
            raise PlanDataError(
                f"line {line}: nested deeper than {MAX_NESTING} levels of mappings and lists"
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *defaults` may be overridden by its mapping
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise PlanDataError(
                        f"line {line}: duplicate key {key!r} (first at line {first_line[key]}); "
                        "a key may be given once per mapping"
                    )
                first_line[key] = line
            except TypeError:  # an unhashable key: the safe loader's own error names it
                pass
        return super().construct_mapping(node, deep)


# YAML 1.2's floats without a dot (1e-3, 3E4), which PyYAML's YAML 1.1 reads as strings: a plan
# writes learning rates so, and a quoted number is an error (Section), so they must be numbers.
_PlanLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(stream: IO[str] | str) -> Any:
    """The YAML document of ``stream`` (a number such as ``1e-3`` read as YAML 1.2 reads it, a
    float); PlanDataError for a duplicate key or deep nesting,
    yaml.YAMLError for anything else YAML rejects."""
    return yaml.load(stream, Loader=_PlanLoader)  # noqa: S506 (a SafeLoader subclass)


def check_shape(data: Any) -> None:
    """Refuse data nested deeper than MAX_NESTING levels (an alias cycle is infinitely deep) or
    holding more than MAX_VALUES values, naming the YAML path where it happens."""
    values = 0
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(data, ())]
    while stack:  # a walk, not a recursion: the point is to bound what recursions see later
        value, loc = stack.pop()
        values += 1
        if values > MAX_VALUES:
            raise PlanDataError(
                f"more than {MAX_VALUES:,} values (YAML aliases expanded); a plan names its "
                "workload's data, it does not hold it"
            )
        if isinstance(value, dict | list | tuple):
            if len(loc) >= MAX_NESTING:
                raise PlanDataError(
                    f"{_short_path(loc)}: nested deeper than {MAX_NESTING} levels of mappings "
                    "and lists (or a YAML alias that contains itself)"
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((item, (*loc, key)) for key, item in items)


def _short_path(loc: tuple[int | str, ...]) -> str:
    """The dotted YAML path of ``loc``, cut after a few levels when long."""
    return dotted(loc) if len(loc) <= 6 else f"{dotted(loc[:4])}... ({len(loc)} levels)"
