"""Loggers zerocc holds back: torch's where zerocc reports the same failure itself, torchao's of
kernel libraries no zerocc run uses."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

# A full traceback for every fake kernel that raises: capture turns the error into a
# CaptureError (or an opaque region), Inductor's fallbacks into a note
FAKE_KERNELS = "torch._subclasses.fake_tensor"
# "failed (exitcode: 2) local_rank: 0 ...", "Sending process ... closing signal SIGTERM": the
# launcher's own report says how each rank ended, and why
RANK_PROCESSES = "torch.distributed.elastic.multiprocessing.api"
# What importing torchao says on a machine its compiled kernel libraries do not fit (a CPU,
# another GPU, another Python): "Failed to load .../torchao/_C_mxfp8...so" for each, and
# torch's deprecation note for each enum it registers with pytree. zerocc's float8 layers
# (torchao's Python ones) need none of those libraries.
TORCHAO_IMPORT = ("torchao", "torch.utils._pytree")


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


@contextlib.contextmanager
def torchao_import_quiet() -> Iterator[None]:
    """The warnings of torchao's import held back in the body (errors pass), where torchao
    may be imported there for the first time: by zerocc's float8 layers, or by a workload's
    transformers (which imports it where it is installed), in each rank and the launcher."""
    if "torchao" in sys.modules:
        yield
        return
    loggers = [logging.getLogger(name) for name in TORCHAO_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
