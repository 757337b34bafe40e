"""A plain record of a compiled step: what inspection reads, without the runner behind it.

``explain()``, the dumps and calibration are functions over a :class:`StepRecord`
(:meth:`zerocc.runtime.step.StepRunner.record` makes one), so they depend on what a compiled
step *is*, not on how the runner keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.plan import Plan
from zerocc.compiler.state import DEVICE, StateLayout
from zerocc.compiler.units import Unit


@dataclass(frozen=True)
class StepRecord:
    """One rank's compiled step, as of when the record was taken."""

    plan: Plan
    world_size: int
    mesh: Mesh  # the ranks' layout, the session's (hybrid sharding, tp, pp, ep)
    rank: int
    device_type: str  # "cpu" | "cuda": the rates a prediction uses
    on_gloo: bool  # whether its collectives run on gloo (its buffers are predicted memory)
    units: list[Unit]
    layout: StateLayout  # the persistent state its programs bind
    # The compiled programs of the first batch shape, by whether they step (empty before the
    # first call).
    programs: dict[bool, fx.GraphModule]
    program: fx.GraphModule | None  # the last program run (or built)
    records: list[PassRecord]  # what each pass did to it
    state_bytes: dict[str, dict[str, int]]  # measured, by location (device, host, nvme)
    loss_scale: float | None  # the next step's; None without loss scaling
    dynamic_loss_scale: bool  # whether the scale adapts to overflows
    backend: str  # the backend that runs the programs (backend.name, auto resolved)
    kernels: str  # the kernel set zerocc's ops run (backend.kernels, auto resolved)
    host_kernels: str | None  # the host updates' on a GPU machine (None: there are none)
    backend_notes: list[str]  # what the backend made of the programs (explain prints them)
    backend_artifacts: dict[str, str]  # what it generated for the last program (the dumps)
    steps: int  # optimizer steps applied
    skipped_steps: int  # optimizer steps skipped for a non-finite gradient
    initial_weights: str | None = None  # where the initial weights came from (a WeightSource)
    units_note: str | None = None  # what `units: auto` chose (None: the plan named its units)
    float8_note: str | None = None  # the layers it multiplies in float8 (None: none)
    # Seconds spent before training, by phase: model states (built, placed, pinned), host
    # update kernels (compiled), capture and passes, lowering (the backend), first run (each
    # program's, with what its backend compiles then); summed over the programs built.
    setup_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the live persistent params, grads and optimizer states on the device."""
        return self.state_bytes[DEVICE]
