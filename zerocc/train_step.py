"""TrainStep: the compiled training step a user calls, under every plan, and what users read
about it.

The running is the runtime's (:class:`zerocc.runtime.step.StepRunner`: the step loop, over
its programs or, under a pipeline, its rank's schedule walk
(:mod:`zerocc.runtime.pipeline_rank`), its state store and the ranks' agreement); this layer
adds what users call and
read about it: the state (:meth:`TrainStep.full_state_dict`, :meth:`TrainStep.materialize_model`,
:meth:`TrainStep.state_dict`, checkpoints), :meth:`TrainStep.summary`,
:meth:`TrainStep.explain` and the dumps that ``ZEROCC_DUMP_DIR`` (or the plan's ``dumps.dir``)
asks for, the last two from the inspect layer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from zerocc.compiler.capture import LossFn
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.plan import Plan
from zerocc.cost.memory import model_state_bytes_of, predict_memory
from zerocc.cost.pipeline_memory import PipelineMemory
from zerocc.engine.comm import Comm
from zerocc.errors import NotSupportedError
from zerocc.inspect import pipeline_report
from zerocc.inspect.dumps import (
    RunDumps,
    dump_dir,
    write_compiled_dumps,
    write_program_dumps,
    write_run_dumps,
)
from zerocc.inspect.explain import explain_step
from zerocc.inspect.pipeline_dumps import write_step_run
from zerocc.runtime.allocations import peak_allocated
from zerocc.runtime.checkpoint import load_checkpoint, save_checkpoint
from zerocc.runtime.checkpoint.background import PendingSave, SavesInBackground
from zerocc.runtime.checkpoint.load import fill_state, open_checkpoint, restore_counters
from zerocc.runtime.checkpoint.rank_state import (
    load_rank_state_dict,
    rank_state_dict,
    restore_rank_counters,
)
from zerocc.runtime.step import StepObserver, StepRunner


class DumpsObserver(StepObserver):
    """The dumps ``ZEROCC_DUMP_DIR`` (or the plan's ``dumps.dir``) asks for, written as a step
    runner compiles and runs: every program's passes (rank 0), then the first micro-batch that
    updates run op by op on the eager binding, timed, on every rank (a compiled region would be
    one call: its ops untimed, the values it holds unseen); under a backend that compiles, the
    next one that updates runs the backend's code, measured (rank 0). Under a pipeline: each
    pipeline rank's programs (by the first rank of its stages), and each of the first two
    steps every rank ran beside the predicted one (:mod:`zerocc.inspect.pipeline_dumps`)."""

    keeps_pass_graphs = True

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._run_dumped = False
        self._compiled_dump: RunDumps | None = None  # rank 0's, until the compiled step ran

    def program_built(self, runner: StepRunner, name: str, records: list[PassRecord]) -> None:
        writes = runner.comm.rank == 0
        if runner.pipeline is not None:  # the first rank that holds its stages
            writes = runner.comm.rank % runner.mesh.stage_ranks == 0
        if writes:
            write_program_dumps(self.folder, name, records)

    def run_step(
        self, runner: StepRunner, batch: tuple, step: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        if runner.pipeline is not None:
            loss = step()
            if runner.micro_batches <= 2:
                write_step_run(runner)
            return loss
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


class TrainStep(StepRunner, SavesInBackground):
    """The compiled training step, under every plan (a pipeline's too). See
    :func:`zerocc.compile`."""

    def __init__(
        self, model: nn.Module, plan: Plan, loss_fn: LossFn | None, comm: Comm, device: torch.device
    ) -> None:
        # The observer is set before the runner compiles anything (it keeps pass graphs).
        self.dump_dir = dump_dir(plan)
        if self.dump_dir is not None:
            self.observer = DumpsObserver(self.dump_dir)
        super().__init__(model, plan, loss_fn, comm, device)

    def explain(self) -> str:
        """Units, bytes each collective moves per step, model-state bytes per rank vs formula;
        a pipeline rank's: the cut, its schedule with the predicted bubble, the last step's
        measured waiting, and its predicted memory."""
        if self.pipeline is not None:
            self._built()
            return pipeline_report.explain(self)
        return explain_step(self.record())

    def summary(self) -> dict[str, Any]:
        """Figures of the last step: bytes per collective kind, model-state bytes per rank (on
        the device), bytes offload moved per direction, the loss scale (None without scaling),
        the steps skipped for a non-finite gradient (see :attr:`skipped_steps`) and the seconds
        spent before training, by phase. A pipeline rank's counts the bytes it sends to its
        neighbours (``send``), and adds the share of the step it waited for them and its
        predicted peak (:func:`zerocc.inspect.pipeline_report.summary`)."""
        if self.pipeline is not None:
            self._built()
            return pipeline_report.summary(self)
        return {
            "comm_bytes_per_step": dict(self.comm.stats.bytes),
            "model_state_bytes": self.model_state_bytes()["total"],
            "offload_bytes_per_step": dict(self.transfers.stats.bytes),
            "loss_scale": self.loss_scale,
            "skipped_steps": self.skipped_steps,
            "setup_seconds": dict(self.setup_seconds),
        }

    def predicted_peak_bytes(self) -> int:
        """The predicted device peak of the last program run (its model states, transients
        and, on gloo, the collectives' buffers) plus what it holds on the host: what
        ``zerocc train`` reports to its launcher. A pipeline rank's: its predicted peak over
        its schedule (:mod:`zerocc.cost.pipeline_memory`)."""
        if self.pipeline is not None:
            return self.memory().peak
        states = model_state_bytes_of(self.layout)
        timeline = predict_memory(self.program, states, gloo=self.comm.on_gloo)
        return timeline.peak()[1] + timeline.host_peak

    def counted_programs(self) -> list[tuple[fx.GraphModule, int]]:
        """The programs whose model FLOPs one call counts, each with how many times a call runs
        it: the last program run, once; a pipeline rank's stages' forwards, once per
        micro-batch (the ranks' calls sum to the model's work)."""
        if self.pipeline is not None:
            return self.pipeline.counted_programs()
        return [(self.program, 1)]

    def memory(self) -> PipelineMemory:
        """A pipeline rank's predicted device peak: its model states, what its stages keep
        for backward over the schedule's micro-batches in flight, and the running program's
        transients (:mod:`zerocc.cost.pipeline_memory`); NotSupportedError without a
        pipeline (see :meth:`predicted_peak_bytes`)."""
        if self.pipeline is None:
            raise NotSupportedError(
                "memory() is a pipeline rank's walk of its schedule (parallel.pp > 1); "
                "predicted_peak_bytes() gives any step's predicted peak"
            )
        self._built()
        return self.pipeline.predicted_memory

    def backend_notes(self) -> dict[str, list[str]]:
        """What the backend made of each program, by program name (``step-0``; a pipeline
        rank's ``rank0-stage1-F``, ``rank0-update``): compiled whole or by region, and why."""
        if self.pipeline is not None:
            self._built()
            return pipeline_report.backend_notes(self)
        kinds = {True: "step", False: "accumulate", "evaluate": "evaluate"}
        return {f"{kinds[boundary]}-{i}": p.notes()
                for i, ((_, boundary), p) in enumerate(self.programs.items())}  # fmt: skip

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full tensor on CPU}`` for every key of ``model.state_dict()``, in the model's
        dtypes: the master weights under mixed precision.

        A collective when the weights are sharded (stage 3; stages 1-2 under mixed precision,
        whose masters are sharded; always under a pipeline, whose ranks hand each other their
        stages' parts): call it on every rank. The whole model on every rank, whatever the
        mesh.
        """
        self._built()
        self._at_the_same_point("full_state_dict()")
        self.apply_carried_update()
        return self._whole_state()

    def _whole_state(self) -> dict[str, torch.Tensor]:
        if self.pipeline is not None:
            return self.pipeline.whole_state()
        return self.state.full_state_dict()

    def materialize_model(self, device: str | torch.device = "cpu") -> nn.Module:
        """The model given to ``compile`` (which sits on ``meta`` once the step owns its
        weights) with the step's current weights and buffers, on ``device``: to evaluate it,
        generate with it or save it as usual. A copy: the step trains its own weights, so call
        again for newer ones. Every rank holds the whole model afterwards; a collective where
        the weights are sharded (see :meth:`full_state_dict`): call it on every rank."""
        self._built()
        self._at_the_same_point("materialize_model()")
        self.apply_carried_update()
        whole = self.pipeline.whole_state() if self.pipeline is not None else None
        return self.state.materialize_model(self.model, device, whole)

    def _at_the_same_point(self, call: str) -> None:
        """Every rank makes ``call`` after the same micro-batch, or an error on every rank
        (:meth:`~zerocc.runtime.agreement.RankAgreement.at_the_same_point`)."""
        self.agreement.at_the_same_point(call, self.micro_batches)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards, optimizer state and counters, ready for
        ``torch.distributed.checkpoint.save`` (or ``torch.save``). Tensor keys carry the rank
        (``rank1/transformer.h.0.param``) since every rank holds different shards; reload
        with the same plan and world size. Applies an offload's deferred update in flight
        first, which under stages 1-2 all-gathers: call it on every rank then."""
        self._built()
        return rank_state_dict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (after ``dcp.load(sd, ...)`` filled it in).
        Before a pipeline's first call: the counters now, the tensors once the first batch
        has cut its stages."""
        if self.pipeline is not None and not self.pipeline.built:
            restore_rank_counters(self, sd)
            self._resume_from = lambda: self.state.load_state_dict(sd)
            return
        load_rank_state_dict(self, sd)

    def save(self, folder: str | Path, keep: int | None = None) -> Path:
        """Save a checkpoint under ``folder`` (``step-<n>``, n: optimizer steps taken) that
        loads under any world size, stage, units, precision or offload; returns its path.
        Every rank writes its own slices, and the checkpoint appears by one rename once all are
        on disk (an interrupted save leaves the earlier ones intact); only the newest ``keep``
        are kept. Call on every rank, after a step's last micro-batch (see also
        :meth:`save_async`)."""
        self._built()
        self.wait_for_save()
        return save_checkpoint(self, folder, keep)

    def save_async(self, folder: str | Path, keep: int | None = None) -> PendingSave:
        """Save in the background (see :class:`~zerocc.runtime.checkpoint.background.
        SavesInBackground`)."""
        self._built()
        return super().save_async(folder, keep)

    def load(self, path: str | Path) -> list[str]:
        """Load a checkpoint (a ``step-<n>`` folder, or a folder of them: the newest) saved
        by :meth:`save` under any world size or stage; every slice read is checked against
        its checksum. Returns notes on what differs from the run that saved it (world size,
        stage, ...). Call on every rank. Before a pipeline's first call the checkpoint is
        found and checked now (the counters set), and its tensors read once the first batch
        has cut the stages."""
        self.wait_for_save()
        if self.pipeline is not None and not self.pipeline.built:
            folder, manifest = open_checkpoint(self, path)
            self._resume_from = lambda: fill_state(self, folder, manifest)
            return restore_counters(self, manifest.meta)
        _, notes = load_checkpoint(self, path)
        return notes
