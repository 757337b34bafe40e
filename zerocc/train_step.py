"""TrainStep: the compiled training step a user calls, and what users read about it.

The running is the runtime's (:class:`zerocc.runtime.step.StepRunner`: programs, state,
agreement, checkpoints); this layer adds :meth:`TrainStep.explain` and the dumps that
``ZEROCC_DUMP_DIR`` (or the plan's ``dumps.dir``) asks for, both from the inspect layer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from zerocc.compiler.capture import LossFn
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.plan import Plan
from zerocc.engine.comm import Comm
from zerocc.inspect.dumps import (
    RunDumps,
    dump_dir,
    write_compiled_dumps,
    write_program_dumps,
    write_run_dumps,
)
from zerocc.inspect.explain import explain_step
from zerocc.runtime.allocations import peak_allocated
from zerocc.runtime.checkpoint import load_checkpoint, save_checkpoint
from zerocc.runtime.step import StepObserver, StepRunner


class DumpsObserver(StepObserver):
    """The dumps ``ZEROCC_DUMP_DIR`` (or the plan's ``dumps.dir``) asks for, written as a step
    runner compiles and runs: every program's passes (rank 0), then the first micro-batch that
    updates run op by op on the eager binding, timed, on every rank (a compiled region would be
    one call: its ops untimed, the values it holds unseen); under a backend that compiles, the
    next one that updates runs the backend's code, measured (rank 0)."""

    keeps_pass_graphs = True

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._run_dumped = False
        self._compiled_dump: RunDumps | None = None  # rank 0's, until the compiled step ran

    def program_built(self, runner: StepRunner, name: str, records: list[PassRecord]) -> None:
        if runner.comm.rank == 0:
            write_program_dumps(self.folder, name, records)

    def run_step(
        self, runner: StepRunner, batch: tuple, step: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        if not runner.updates_next:
            return step()
        if not self._run_dumped:
            self._run_dumped = True
            compiles = runner.backend_name != "eager"
            loss, recorder = runner.profile(*batch, backend="eager" if compiles else None)
            dumps = write_run_dumps(self.folder, runner.record(), recorder, runner.comm)
            if compiles:
                self._compiled_dump = dumps
            return loss
        if self._compiled_dump is not None:
            dumps, self._compiled_dump = self._compiled_dump, None
            trace = self.folder / "backend" / "trace.json"
            loss, allocated = peak_allocated(step, runner.device, trace)
            write_compiled_dumps(dumps, trace, allocated, runner.backend_name)
            return loss
        return step()


class TrainStep(StepRunner):
    """The compiled training step. See :func:`zerocc.compile`."""

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        # The observer is set before the runner compiles anything (it keeps pass graphs).
        self.dump_dir = dump_dir(plan)
        if self.dump_dir is not None:
            self.observer = DumpsObserver(self.dump_dir)
        super().__init__(model, plan, loss_fn, comm, device)

    def explain(self) -> str:
        """Units, bytes each collective moves per step, model-state bytes per rank vs formula."""
        return explain_step(self.record())

    def save(self, folder: str | Path, keep: int | None = None) -> Path:
        """Save a checkpoint under ``folder`` (``step-<n>``, n: optimizer steps taken) that
        loads under any world size, stage, units, precision or offload; returns its path.
        Every rank writes its own slices, and the checkpoint appears by one rename once all are
        on disk (an interrupted save leaves the earlier ones intact); only the newest ``keep``
        are kept. Call on every rank, after a step's last micro-batch."""
        return save_checkpoint(self, folder, keep)

    def load(self, path: str | Path) -> list[str]:
        """Load a checkpoint (a ``step-<n>`` folder, or a folder of them: the newest) saved
        by :meth:`save` under any world size or stage; every slice read is checked against
        its checksum. Returns notes on what differs from the run that saved it (world size,
        stage, ...). Call on every rank."""
        _, notes = load_checkpoint(self, path)
        return notes
