"""torch's loggers that zerocc silences where it reports the same failure itself."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# A full traceback for every fake kernel that raises: capture turns the error into a
# CaptureError (or an opaque region), Inductor's fallbacks into a note
FAKE_KERNELS = "torch._subclasses.fake_tensor"
# "failed (exitcode: 2) local_rank: 0 ...", "Sending process ... closing signal SIGTERM": the
# launcher's own report says how each rank ended, and why
RANK_PROCESSES = "torch.distributed.elastic.multiprocessing.api"


@contextlib.contextmanager
def quiet(name: str) -> Iterator[None]:
    """The logger ``name`` off in the body (only critical records pass), as it was after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
