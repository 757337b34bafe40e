"""The launcher's watch over its ranks (zerocc/runtime/launch.py): which ranks it kills, and
what the failure report then says of them, on real processes standing in for ranks."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

from zerocc.runtime.launch import _SilentRankKiller, failure_report


def _watch_ranks(tmp_path: Path, pids: dict[int, int], silent: dict[int, list[int]]) -> dict:
    """Write rank reports (``silent``: reporting rank -> the ranks it found silent) and let the
    launcher's watch act on them; what it killed and why."""
    for rank, pid in pids.items():
        named = [{"rank": r, "pid": pids[r], "host": socket.gethostname()}
                 for r in silent.get(rank, [])]  # fmt: skip
        report = {"rank": rank, "pid": pid, **({"silent": named} if named else {})}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(report))
    watch = _SilentRankKiller(tmp_path)
    time.sleep(1.0)
    watch.stop()
    return {"killed": watch.killed, "why": watch.why}


def test_the_launcher_counts_as_its_kill_only_a_rank_it_found_alive(tmp_path):
    """Rank 0 reports rank 1 silent, but rank 1 is dead already (SIGKILLed from elsewhere,
    say mid-save): the launcher does not claim it killed it. A stopped rank it does kill."""
    reporter = subprocess.Popen(["true"])  # (rank 0 has exited with its report: acted on)
    reporter.wait()
    gone = subprocess.Popen(["sleep", "60"])
    gone.kill()
    time.sleep(0.2)  # (a zombie until reaped: what torchrun's agent has not yet waited for)
    seen = _watch_ranks(tmp_path, {0: reporter.pid, 1: gone.pid}, {0: [1]})
    gone.wait()
    assert seen["killed"] == {}, seen
    stopped = subprocess.Popen(["sleep", "60"])
    stopped.send_signal(signal.SIGSTOP)
    try:
        seen = _watch_ranks(tmp_path, {0: reporter.pid, 1: stopped.pid}, {0: [1]})
        assert stopped.wait(5) == -signal.SIGKILL
    finally:
        stopped.kill()
    assert seen["killed"] == {1: stopped.pid}
    assert seen["why"][1].startswith("it stopped answering its peers (rank 0 reported it silent)")


def test_a_rank_still_stopped_when_another_ended_is_killed_at_once(tmp_path):
    """torchrun's SIGTERM waits on a stopped process, and its SIGKILL comes 30 s later: the
    launcher kills it at once, and says it did and why."""
    ended = subprocess.Popen(["true"])
    time.sleep(0.2)
    stopped = subprocess.Popen(["sleep", "60"])
    stopped.send_signal(signal.SIGSTOP)
    try:
        seen = _watch_ranks(tmp_path, {0: ended.pid, 1: stopped.pid}, {})
        assert stopped.wait(5) == -signal.SIGKILL
    finally:
        stopped.kill()
        ended.wait()
    assert seen["killed"] == {1: stopped.pid}
    why = seen["why"][1]
    assert why == "it was stopped (SIGSTOP) when rank 0 ended, and the launcher killed it"
    text = failure_report({1: (-signal.SIGKILL, stopped.pid)}, {}, seen["killed"], why=seen["why"])
    assert f"rank 1 (pid {stopped.pid}): killed by SIGKILL: {why}" in text


def test_a_rank_the_launcher_stopped_after_another_was_killed_is_said_so():
    text = failure_report({0: (-signal.SIGTERM, 10), 1: (-signal.SIGKILL, 11)}, {}, {})
    assert "rank 0 (pid 10): killed by SIGTERM: stopped by the launcher after rank 1 (killed " \
        "by SIGKILL) ended" in text
    assert "not by this launcher's watch" in text and "or by torchrun 30 s after" in text
