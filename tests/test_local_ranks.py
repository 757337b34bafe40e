"""A rank's place on its machine, read once from its launcher's environment: torchrun's
figures where set, the caller's assumption where not, and a clear error for a value torchrun
would never set."""

from __future__ import annotations

import pytest

from zerocc.errors import ZeroccError
from zerocc.local_ranks import local_rank, ranks_on_this_machine


def test_torchruns_figures_are_read_and_the_callers_assumption_stands_in(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_rank() == 0 and ranks_on_this_machine(unknown=4) == 4
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_rank() == 2 and ranks_on_this_machine(unknown=1) == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_on_this_machine(unknown=1) == 3  # (rank 2 of its machine: at least 3 there)


@pytest.mark.parametrize(("name", "value"), [("LOCAL_WORLD_SIZE", "0"), ("LOCAL_RANK", "one"),
                                             ("LOCAL_WORLD_SIZE", "-2")])  # fmt: skip
def test_a_value_torchrun_would_not_set_is_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ZeroccError, match=f"{name}='{value}': a whole number"):
        ranks_on_this_machine(unknown=1)
