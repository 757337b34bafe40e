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
from zerocc.runtime.measure import ProfiledRun
from zerocc.runtime.step import Program, StepRunner


class TrainStep(StepRunner):
    """The compiled training step. See :func:`zerocc.compile`."""

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        super().__init__(model, plan, loss_fn, comm, device)
        self.dump_dir = dump_dir(plan)
        self._run_dumped = False
        self._compiled_dump: RunDumps | None = None  # rank 0's, until the compiled step ran

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

    def _step(
        self, batch: tuple, recorded: Callable[[Program], ProfiledRun] | None = None
    ) -> torch.Tensor:
        if self.dump_dir and not self._run_dumped and recorded is None and self._steps_next():
            # Dumps: the first step that runs the optimizer runs op by op on the eager binding,
            # timed, on every rank (a compiled region would be one call: its ops untimed, the
            # values it holds unseen). Under a backend that compiles, the next step that steps
            # runs the backend's code, measured (rank 0).
            self._check_usable()
            self._run_dumped = True
            compiles = self.backend_name != "eager"
            loss, recorder = self.profile(*batch, backend="eager" if compiles else None)
            dumps = write_run_dumps(self.dump_dir, self.record(), recorder, self.comm)
            if compiles:
                self._compiled_dump = dumps
            return loss
        if self._compiled_dump is not None and recorded is None and self._steps_next():
            dumps, self._compiled_dump = self._compiled_dump, None
            trace = self.dump_dir / "backend" / "trace.json"
            loss, allocated = peak_allocated(
                lambda: super(TrainStep, self)._step(batch), self.device, trace
            )
            write_compiled_dumps(dumps, trace, allocated, self.backend_name)
            return loss
        return super()._step(batch, recorded)

    def _keeps_pass_graphs(self) -> bool:
        return self.dump_dir is not None

    def _program_built(self, name: str, records: list[PassRecord]) -> None:
        if self.dump_dir is not None and self.comm.rank == 0:
            write_program_dumps(self.dump_dir, name, records)
