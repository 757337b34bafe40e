"""Plan fields renamed: a plan that uses an old name is read under the new one, with a
warning."""

from __future__ import annotations

import warnings
from typing import Any

from zerocc.errors import RenamedFieldWarning

# Fields renamed, by their old dotted names: a plan that uses an old name is read under the new
# one, with a warning that says it. Each old name meant two things: `checkpointing` (recompute,
# or saving?) and `offload.pipeline` (the host updates deferred, or pipeline parallelism?).
RENAMED_FIELDS = {"checkpointing": "recompute", "offload.pipeline": "offload.defer_updates"}


def read_renamed(data: Any, path: list[str], old: str, new: str) -> Any:
    """``data`` with the field at ``path`` (the rest of ``old``) moved to the last name of
    ``new`` beside it, copying only the mappings on the way (the caller's stay as they were);
    warns that it did."""
    if not isinstance(data, dict) or path[0] not in data:
        return data
    if len(path) > 1:
        inner = read_renamed(data[path[0]], path[1:], old, new)
        return data if inner is data[path[0]] else {**data, path[0]: inner}
    key = new.rpartition(".")[2]
    if key in data:
        raise ValueError(f"{old}: is the old name of {new}:, and the plan gives both; keep {new}:")
    warnings.warn(
        f"plan: `{old}:` is now `{new}:` (read under the new name for now; rename it)",
        RenamedFieldWarning,
        stacklevel=4,
    )
    renamed = {k: v for k, v in data.items() if k != path[0]}
    renamed[key] = data[path[0]]
    return renamed
