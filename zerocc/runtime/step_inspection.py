"""What a step runner shows of its programs for inspection: the last program run, what each pass
did to it, a plain record of the compiled step (:mod:`zerocc.runtime.record`) and the model
states it holds. Apart from the step loop (:mod:`zerocc.runtime.step`), which it reads."""

from __future__ import annotations

from torch import fx

from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.passes.partition import auto_units_note
from zerocc.compiler.state import DEVICE
from zerocc.runtime.programs import LoweredProgram
from zerocc.runtime.record import StepRecord


class StepInspection:
    """The inspection half of :class:`~zerocc.runtime.step.StepRunner` (its base): what it
    reads is the runner's."""

    programs: dict[tuple, LoweredProgram]
    _last_program: LoweredProgram | None

    @property
    def program(self) -> fx.GraphModule:
        """The scheduled graph of the last program run (or built)."""
        return self._shown_or_none_yet().gm

    @property
    def records(self) -> list[PassRecord]:
        """What each pass did to the last program: time, ops added and removed (and the graph
        after it where dumps keep it)."""
        return self._shown_or_none_yet().records

    @property
    def _shown(self) -> LoweredProgram | None:
        """The program inspection shows: the last one run, else the first one built."""
        return self._last_program or next(iter(self.programs.values()), None)

    def _shown_or_none_yet(self) -> LoweredProgram:
        if self._shown is None:
            raise RuntimeError("no program yet: call step(*batch) once to compile")
        return self._shown

    def record(self) -> StepRecord:
        """A plain record of this compiled step, for inspection (:mod:`zerocc.runtime.record`)."""
        last, first = self._shown, next(iter(self.programs), (None,))[0]
        float8 = self.session.float8
        return StepRecord(
            plan=self.plan,
            world_size=self.comm.world_size,
            mesh=self.mesh,
            rank=self.comm.rank,
            device_type=self.device.type,
            on_gloo=self.comm.on_gloo,
            units=self.units,
            layout=self.layout,
            programs={b: p.gm for (sig, b), p in self.programs.items() if sig == first},
            program=last.gm if last else None,
            records=last.records if last else [],
            state_bytes=self.state.bytes_by_location(),
            loss_scale=self.loss_scale,
            dynamic_loss_scale=bool(self.loss_scaler and self.loss_scaler.dynamic),
            backend=self.backend_name,
            kernels=self.kernels,
            host_kernels=self.host_kernels,
            backend_notes=list(
                dict.fromkeys(note for p in self.programs.values() for note in p.notes())
            ),
            backend_artifacts=last.run.artifacts() if last else {},
            steps=self.steps,
            skipped_steps=self.skipped_steps,
            initial_weights=self.initial_weights,
            units_note=auto_units_note(self.session.model_info, self.plan.units.classes),
            float8_note=float8.describe(self.device.type) if float8 is not None else None,
            setup_seconds=dict(self.setup_seconds),
        )

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the live persistent params, grads and optimizer states of this rank on the
        device (measured); what offload placed elsewhere is in
        :meth:`~zerocc.runtime.state_store.StateStore.bytes_by_location`."""
        return self.state.bytes_by_location()[DEVICE]
