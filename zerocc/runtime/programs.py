"""Programs as a rank runs them: compiled by the compile session, checked alike on every rank,
lowered by the plan's backend and bound to the step's runtime context.

:class:`ProgramBuilder` turns a batch into a :class:`LoweredProgram`: capture and passes (the
session's), the ranks' agreement on the scheduled graph (a mismatch names the first differing
line), the memory check, the lowering (the ranks meet after it: Inductor may compile for
minutes on one rank and hit its cache on another) and a warning where the ranks lowered it
apart.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from zerocc.backends import Executable, get_backend
from zerocc.compiler.driver.pass_manager import PassRecord
from zerocc.compiler.driver.program import CompiledProgram
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.plan import Plan
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import Comm
from zerocc.errors import InvariantError, LoweringWarning
from zerocc.ir.nodes import FOUND_INF, info, placeholders, val
from zerocc.ir.printing import format_program
from zerocc.runtime.agreement import RankAgreement, agrees_at_first_collective, digest
from zerocc.runtime.memory_check import check_step_memory


@dataclass
class LoweredProgram:
    """One program as this rank runs it: the scheduled graph (of the compiler's
    :class:`~zerocc.compiler.driver.program.CompiledProgram`), how it was built, and the
    executable the backend lowered it to, bound to the step's runtime context."""

    gm: fx.GraphModule
    records: list[PassRecord]
    bindings: list[tuple[str, str]]  # (role, key) per placeholder, in order
    example_inputs: list[Any]  # the placeholders' fake values
    run: Executable  # bound to the step's runtime context
    digest: str
    returns_found_inf: bool  # returns (loss, [flags,] found_inf): it steps, gated on the flag
    agrees_at_first_collective: bool  # the batch agreement may be settled that late
    carries: bool = False  # begins with the last step's host updates (offload.defer_updates)
    lowered_apart: str | None = None  # how each rank lowered it, where the ranks differ

    def notes(self) -> list[str]:
        """The backend's lines for ``explain()``, and one where the ranks lowered it apart."""
        return self.run.notes() + ([self.lowered_apart] if self.lowered_apart else [])


def batch_signature(batch: Sequence[Any]) -> tuple:
    """What makes two batches need different programs: tensor shapes/dtypes, other values."""
    return tuple(
        ("tensor", tuple(b.shape), str(b.dtype)) if isinstance(b, torch.Tensor) else ("value", b)
        for b in batch
    )


def bindings_of(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(role, key) of each placeholder of ``gm``, in order: what the runtime binds to it."""
    return [(info(n).role, info(n).key) for n in placeholders(gm)]


class SetupClock:
    """Where the time before training went, by phase (``explain()`` and `zerocc train` say):
    model states, host update kernels, capture and passes, lowering, first run. An object of
    its own, not a method of the step runner, so that what keeps it (the program builder)
    keeps no reference to the runner: a step dropped is freed at once, with its groups."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time the block takes to ``seconds[phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


class ProgramBuilder:
    """Builds the programs of one step runner (see the module's doc): ``session`` compiles,
    ``context`` is what their executables run on, ``agreement`` checks them alike across the
    ranks, ``clock`` accounts the setup time by phase, ``backend_name`` lowers them (resolved:
    :func:`zerocc.backends.resolve_backend`)."""

    def __init__(
        self,
        session: CompileSession,
        context: RuntimeContext,
        agreement: RankAgreement,
        clock: SetupClock,
        backend_name: str,
    ) -> None:
        self.session, self.context, self.agreement, self.clock = session, context, agreement, clock
        self.plan, self.comm, self.device = session.plan, context.comm, context.device
        self.backend_name, self.backend = backend_name, get_backend(backend_name)
        self.builds = 0  # programs compiled, the failed ones too: the same on every rank
        # Programs lowered again on another comm or by another backend (profiling), kept for
        # the next profile of the same program there (a first run costs more than the others),
        # for the last comm asked for (each calibration makes its own): the same on every rank.
        self.lowered_again: dict[tuple[str, Comm, str | None], Executable] = {}
        self.relowerings = 0  # programs lowered again, all told (the ranks meet after each)

    def compile(
        self,
        batch: tuple,
        boundary: bool,
        plan: Plan | None = None,
        keep_graphs: bool = False,
        training: bool = True,
    ) -> CompiledProgram:
        """Capture the step on ``batch`` and run the passes of ``plan`` (default: the step's;
        another one to predict what a plan change would need); ``training=False``: the
        forward-only program of an evaluation."""
        return self.session.program(
            batch,
            boundary=boundary,
            device=self.device,
            plan=plan,
            keep_graphs=keep_graphs,
            training=training,
        )

    def build(
        self,
        batch: tuple,
        boundary: bool,
        training: bool,
        keep_graphs: bool,
        built: Callable[[list[PassRecord]], None],
    ) -> LoweredProgram:
        """Compile, check and lower the program of ``batch`` (``boundary``: it ends with the
        optimizer step); ``built(records)`` is told of it once its passes ran."""
        with self.clock.timed("capture and passes"):
            compiled = self.compile(batch, boundary, keep_graphs=keep_graphs, training=training)
        gm, records = compiled.gm, compiled.records
        built(records)
        layout = self.session.layout
        if compiled.layout != layout:  # the passes declare the same state on every compile
            raise InvariantError(
                "a program's passes laid out other state than the TrainStep allocated: "
                + compiled.layout.difference(layout)
            )
        text = format_program(gm)
        program_digest = digest(text)
        self.builds += 1
        self.agreement.health.wait_for_ranks(f"compiled-{self.builds}", "a program to compile")
        self.agreement.agree(
            ("compiled program", program_digest), "the compiled programs differ across ranks", text
        )
        bindings = bindings_of(gm)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        found_inf = isinstance(outputs, tuple) and info(outputs[-1]).role == FOUND_INF
        late_agreement = agrees_at_first_collective(gm)
        carries = any(info(n).carried for n in gm.graph.nodes)
        if self.plan.backend.check_memory:  # before its first run: the step's memory fits
            check_step_memory(
                gm,
                self.session.units,
                layout,
                self.plan,
                self.comm,
                self.device,
                lambda plan: self.compile(batch, boundary, plan, training=training).gm,
            )
        example_inputs = [val(n) for n in placeholders(gm)]
        with self.clock.timed("lowering"):
            executable = self.backend(gm, example_inputs, self.context)
        # Lowering compiles too (Inductor: seconds to minutes, a cache hit on one rank and not
        # on another): no rank runs the program's first collective while another still lowers.
        self.agreement.health.wait_for_ranks(f"lowered-{self.builds}", "a program to be lowered")
        return LoweredProgram(
            gm,
            records,
            bindings,
            example_inputs,
            executable,
            program_digest,
            found_inf,
            late_agreement,
            carries,
            self._lowered_apart(executable.lowering()),
        )

    def _lowered_apart(self, lowering: str) -> str | None:
        """None when every rank lowered the program as this one did (``lowering``); else a
        line naming each rank's form, warned (:class:`LoweringWarning`) on every rank."""
        views = self.agreement.views_if_they_differ(("program's lowering", lowering), lowering)
        if views is None:
            return None
        forms = "; ".join(f"rank {rank}: {form}" for rank, form in enumerate(views))
        line = (
            f"{self.backend_name}: the ranks lowered this program differently ({forms}); the "
            "collectives are the same, so it trains, each rank's compute rounding its own way; "
            "each rank's explain() says why"
        )
        warnings.warn(line, LoweringWarning, stacklevel=2)
        return line

    def lowered_on(
        self, program: LoweredProgram, comm: Comm, backend: str | None = None
    ) -> Executable:
        """``program`` lowered again by ``backend`` (default: the plan's), its collectives
        bound to ``comm``, or as it was the last time it was asked for; the ranks meet after a
        lowering, as after the program's first (Inductor: a cache hit on one rank may be a full
        compile on another). What was lowered for another comm goes (an earlier
        calibration's)."""
        key = (program.digest, comm, backend)
        if key in self.lowered_again:
            return self.lowered_again[key]
        lower = self.backend if backend is None else get_backend(backend)
        executable = lower(program.gm, program.example_inputs, replace(self.context, comm=comm))
        self.lowered_again = {k: e for k, e in self.lowered_again.items() if k[1] is comm}
        self.lowered_again[key] = executable
        self.relowerings += 1
        self.agreement.health.wait_for_ranks(
            f"relowered-{self.relowerings}", "a program to be lowered"
        )
        return executable
