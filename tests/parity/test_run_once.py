"""``run_once``: the parity files' batches of ranks run once per set of arguments, however a
test names them (each batch is tens of seconds of this 2-core machine's suite)."""

from __future__ import annotations

from parity import run_once


def test_a_default_given_or_left_out_is_one_run():
    calls = []

    @run_once
    def runs(world: int, slow: bool = False) -> int:
        calls.append((world, slow))
        return len(calls)

    assert runs(2) == runs(2, False) == runs(2, slow=False) == runs(world=2) == 1
    assert runs(2, True) == 2
    assert calls == [(2, False), (2, True)]
