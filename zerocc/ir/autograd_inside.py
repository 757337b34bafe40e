"""Autograd inside an op's kernel: what runs a module's forward again to differentiate it (an
opaque region's backward, expert parallelism's experts) where the dispatcher has already gone
below autograd."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd records again in the body, inside an op's kernel (which the dispatcher runs
    below autograd: without this, a forward run there would have no graph to differentiate)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    include = torch._C._dispatch_tls_local_include_set()
    recording = exclude.remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(include, recording):
        yield
