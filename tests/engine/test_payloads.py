"""The runtime's payloads: what expert parallelism's exchanges received, kept by key between
the ops that read them (see zerocc/engine/payloads.py)."""

from __future__ import annotations

import pytest
import torch

from zerocc.engine.payloads import Payloads


def test_a_key_is_a_queue_the_newest_read_the_oldest_taken():
    """A pipeline stage runs several micro-batches' forwards before their backwards: each
    forward's experts read what it just put, each backward takes the oldest."""
    held = Payloads()
    first, second = torch.zeros(2, 3), torch.ones(4, 3)
    held.put("call:rows", first)
    held.put("call:rows", second)
    assert held.newest("call:rows") is second and len(held) == 2
    with pytest.raises(RuntimeError, match=r"2 rows .* still kept \(under call:rows\)"):
        held.check_taken()
    assert held.take("call:rows") is first
    assert held.take("call:rows") is second
    assert len(held) == 0
    held.check_taken()


def test_reading_what_was_never_kept_names_the_key():
    held = Payloads()
    with pytest.raises(RuntimeError, match="no payload under 'call:rows'"):
        held.take("call:rows")
    held.put("call:rows", torch.zeros(1))
    held.clear()
    with pytest.raises(RuntimeError, match="call:rows"):
        held.newest("call:rows")
