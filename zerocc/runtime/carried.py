"""The update a step carries into the next (``offload.defer_updates``).

With deferred updates a step's host updates run at the start of the next step's program,
behind its forward. What they read that no step copies (the step count and rate of the update
pending, or a skip) is set in host buffers before each such program runs; anything that reads
the weights or optimizer states between steps (a save or load, an evaluation, the full state)
applies the pending update first, with a program of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from zerocc.backends import get_backend
from zerocc.compiler.capture import detach_inputs, traced_grad_mode
from zerocc.compiler.passes.support.deferred_updates import (
    CARRIED_LR,
    CARRIED_SCALARS,
    CARRIED_SKIP,
    CARRIED_STEP,
    carried_program,
)
from zerocc.engine import RuntimeContext
from zerocc.ir.nodes import placeholders, val
from zerocc.runtime.programs import LoweredProgram, bindings_of
from zerocc.runtime.state_store import StateStore


class CarriedUpdate:
    """The update pending between two steps of one rank (``pending``: its 1-based step count
    and learning rate, None when none is), run on ``context`` over ``state``."""

    def __init__(self, state: StateStore, context: RuntimeContext) -> None:
        self.state, self.context = state, context
        self.pending: tuple[int, float] | None = None
        self._drain: LoweredProgram | None = None  # applies it on its own, once made

    def set_inputs(self) -> None:
        """What a deferred-update program's carried updates read that no step copies: the step count
        and rate of the update pending, or a skip when none is (or that step overflowed)."""
        step, lr = self.pending or (1, 0.0)
        values = {CARRIED_SKIP: float(self.pending is None), CARRIED_STEP: step, CARRIED_LR: lr}
        for key, dtype in CARRIED_SCALARS.items():
            self.context.transfers.host_buffers.get(key, (1,), dtype).fill_(values[key])

    def apply(self, programs: Iterable[LoweredProgram]) -> None:
        """Apply the pending update now, with what the step left in host buffers (nothing to do
        when none is pending), by a program made once from the step's program that carries
        (among ``programs``). Under stage 3 local to the rank; under stages 1-2 on more than
        one rank it all-gathers the updated shards, so every rank calls it together."""
        if self.pending is None:
            return
        if self._drain is None:
            stepping = next(p for p in programs if p.carries)
            gm = carried_program(stepping.gm)
            inputs = [val(n) for n in placeholders(gm)]
            run = get_backend("eager")(gm, inputs, self.context)  # host work: nothing to fuse
            bindings = bindings_of(gm)
            self._drain = LoweredProgram(
                gm, [], bindings, inputs, run, "", False, False, carries=True
            )
        self.set_inputs()
        drain = self._drain
        try:
            with traced_grad_mode():
                drain.run(*detach_inputs([self.state[k] for _, k in drain.bindings]))
        except BaseException:
            drain.run.reset()
            raise
        self.pending = None
