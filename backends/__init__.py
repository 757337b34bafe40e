"""Backends: turn a scheduled program into a callable. ``eager`` runs it node by node."""

from collections.abc import Callable
from typing import Any

from torch import fx
from zerocc.backends import eager

BACKENDS: dict[str, Callable[[fx.GraphModule], Callable[..., Any]]] = {"eager": eager.compile}


def get_backend(name: str) -> Callable[[fx.GraphModule], Callable[..., Any]]:
    """The compile function of backend ``name``."""
    return BACKENDS[name]
