"""What a restart tells (zerocc/runtime/restarts.py): the launcher's record of a failed attempt,
read by the next attempt's rank 0 for its restart line and its summary. (The whole path, a rank
killed under `zerocc train --max-restarts 1`, is tested in tests/test_rank_failures.py.)"""

from __future__ import annotations

import signal
from types import SimpleNamespace

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from zerocc.runtime import restarts
from zerocc.runtime.restarts import (
    StepProgress,
    losses_recorded,
    lost_before,
    note_resumed,
    restart_summary,
)


def _attempt(monkeypatch, tmp_path, attempt: int, rank: int = 0) -> None:
    monkeypatch.setenv(restarts.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    monkeypatch.setenv("RANK", str(rank))


def _fail_attempt(monkeypatch, tmp_path, remaining: int) -> None:
    """The agent's monitor finds rank 1 killed by SIGKILL, with ``remaining`` restarts left."""
    failure = SimpleNamespace(exitcode=-signal.SIGKILL, pid=42)
    result = SimpleNamespace(state=SimpleNamespace(name="FAILED"), failures={1: failure})
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda agent, group: result)
    agent = SimpleNamespace(_remaining_restarts=remaining)
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=2))

    def describe(failures):
        return [f"rank {r} (pid {pid}): exit {code}" for r, (code, pid) in failures.items()]

    with losses_recorded(tmp_path, describe):
        assert LocalElasticAgent._monitor_workers(agent, group) is result


def test_a_failed_attempt_is_told_by_the_next_and_counted_at_the_end(monkeypatch, tmp_path):
    for rank, steps in ((0, 5), (1, 4)):  # attempt 0: rank 0 reached step 5, rank 1 step 4
        _attempt(monkeypatch, tmp_path, 0, rank)
        progress = StepProgress()
        for step in range(1, steps + 1):
            progress.note(step)
        progress.close()
    _fail_attempt(monkeypatch, tmp_path, remaining=2)  # (attempt 0 of 2 restarts)
    _attempt(monkeypatch, tmp_path, 1)
    assert lost_before(1) == "rank 1 (pid 42): exit -9"
    note_resumed(1, 4)  # from the checkpoint of step 4
    assert restart_summary(1) == (
        "restarts: 1; 1 step(s) recomputed (trained again after the checkpoint each restart "
        "loaded)"
    )
    assert restart_summary(0) is None


def test_nothing_is_recorded_without_a_restart_to_come(monkeypatch, tmp_path):
    _fail_attempt(monkeypatch, tmp_path, remaining=0)  # (the run ends: the report says it)
    _attempt(monkeypatch, tmp_path, 1)
    assert lost_before(1) == ""
    assert restart_summary(1).startswith("restarts: 1; the steps recomputed are unknown")
