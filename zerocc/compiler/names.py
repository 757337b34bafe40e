"""Dotted names (module FQNs, unit names): globs over them, as the plan's `units.modules`,
`units.keep_gathered` and `recompute.units` take them, and the modules a name lies in.

``*`` matches within one dotted component and ``**`` across dots, as path globs do:
``transformer.h.*`` is every block (``transformer.h.0``), not its submodules
(``transformer.h.0.attn``), which ``transformer.h.**`` also matches. ``?`` is one character
other than a dot, ``[0-3]`` and ``[!0]`` are character classes; anything else is literal.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

GLOB_RULE = "'*' matches within a dotted name's component, '**' across dots"


def enclosing(fqn: str) -> Iterator[str]:
    """``fqn`` and each module it lies in, innermost first (``a.b.c``, ``a.b``, ``a``; not the
    root, ``""``): a walk up one name, where a scan over every unit or layer of a deep model
    was quadratic."""
    parts = fqn.split(".") if fqn else []
    for n in range(len(parts), 0, -1):
        yield ".".join(parts[:n])


def glob_matches(name: str, pattern: str) -> bool:
    """Whether dotted ``name`` matches glob ``pattern`` (see the module's docstring)."""
    return _compiled(pattern).fullmatch(name) is not None


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append(r"[^.]*")
        elif char == "?":
            out.append(r"[^.]")
        elif char == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", r"\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out))
