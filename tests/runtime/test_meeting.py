"""What a launcher says while its machine waits for the run's others (zerocc.runtime.meeting);
the launch that says it is tested in tests/cli/test_cli_multinode.py."""

from __future__ import annotations

import subprocess
import sys
import time

from zerocc.runtime import meeting


def test_a_process_has_children_while_one_runs():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"]
    )
    try:
        deadline = time.monotonic() + 30
        while not meeting.has_children(parent.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    assert not meeting.has_children(parent.pid)  # (gone)


# (in a process of its own: a test process may have children of other tests' left)
SCRIPT = """
import subprocess, time
from zerocc.runtime import meeting
meeting.WAIT_NOTICE_S, meeting.WAIT_REPEAT_S = 0.3, 0.4
notices = meeting.WaitNotices("first wait", "second wait", poll_s=0.05)
time.sleep(1.5)  # (no child: the first wait, said at 0.3 s, again at 0.7 s and 1.1 s)
subprocess.run(["sleep", "0.5"])  # (a rank runs, then ends: a restart)
time.sleep(0.8)
notices.stop()
"""


def test_a_wait_is_said_first_as_for_the_others_then_as_meeting_again():
    ran = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    said = ran.stderr.splitlines()
    firsts = [line for line in said if line.startswith("zerocc: first wait; ")]
    seconds = [line for line in said if line.startswith("zerocc: second wait; ")]
    assert ran.returncode == 0 and len(firsts) >= 2 and seconds, said
    assert said.index(seconds[0]) > said.index(firsts[-1])
