"""The example GPT as a workload whose machine is lost: on a launcher started with
``ZEROCC_TEST_LOSE_THIS_NODE`` set, the rank reading its ``kill_at``-th batch clears its
machine's memory (the launch's folder in /dev/shm) and kills its launcher (torchrun's agent) and
itself by SIGKILL, as a machine that goes down takes all three. A launcher
started without it (the replacement) trains on: what `zerocc train --nnodes --max-restarts`
must survive."""

import os
import shutil
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "gpt"))

from workload import workload as gpt  # noqa: E402

from zerocc.runtime.launch import in_memory_folder  # noqa: E402

LOSE_THIS_NODE = "ZEROCC_TEST_LOSE_THIS_NODE"


def workload(kill_at: int, **args):
    """``gpt(**args)``, its machine lost at batch ``kill_at`` (counted from 0) where the
    launcher says so."""
    made = gpt(**args)
    batches = made.batches

    def losing(rank: int, world_size: int):
        for index, batch in enumerate(batches(rank, world_size)):
            if index == kill_at and os.environ.get(LOSE_THIS_NODE):
                shutil.rmtree(in_memory_folder() or "/nonexistent", ignore_errors=True)
                os.kill(os.getppid(), signal.SIGKILL)  # the node's launcher
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    made.batches = losing
    return made
