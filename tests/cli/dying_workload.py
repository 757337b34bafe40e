"""The example GPT as a workload whose rank 1 is killed (SIGKILL, as the out-of-memory killer
or a failing machine ends a process) when it reads its ``kill_at``-th batch, on the run's first
attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), or on every attempt
(``every_attempt``: a rank that cannot come back): what `zerocc train --max-restarts` and
``--nproc-min`` must survive."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "gpt"))

from workload import workload as gpt  # noqa: E402


def workload(kill_at: int, every_attempt: bool = False, **args):
    """``gpt(**args)`` with rank 1 killed at batch ``kill_at`` (counted from 0) of attempt 0
    (of every attempt: ``every_attempt``)."""
    made = gpt(**args)
    batches = made.batches

    def dying(rank: int, world_size: int):
        for index, batch in enumerate(batches(rank, world_size)):
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
            if rank == 1 and index == kill_at and (first_attempt or every_attempt):
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    made.batches = dying
    return made
