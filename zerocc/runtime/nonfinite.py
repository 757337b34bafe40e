"""Steps whose reduced gradient holds an inf or NaN, in plans without loss scaling.

The optimizer pass checks the stepping program's reduced gradient shards with
``zerocc.nonfinite_flags`` (one flag per unit, in update order; all-reduced when ranks hold
slices; the offload pass splits it into one check per gradient, in the same order) and
gates every update on their max, so such a step writes nothing on any rank. The program
returns the flags and the gate; the step runner then counts the step as skipped
(``precision.on_nonfinite: skip``) or raises the :class:`NonFiniteError` built here (``error``).
Every rank read the same all-reduced flags, so every rank raises at the same step.
"""

from __future__ import annotations

import torch
from torch import fx

from zerocc.errors import NonFiniteError
from zerocc.ir.nodes import info, op_name


def nonfinite_units(gm: fx.GraphModule, flags: torch.Tensor) -> list[str]:
    """The units whose flag in ``flags`` (what the program returned) is set, in update order."""
    checks = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and op_name(n.target) == "zerocc.nonfinite_flags"
    ]
    # One flag per gradient: per unit, or at world size 1 per parameter (several per unit);
    # from one check, or one per gradient in the same order (offloaded gradients).
    units = [info(grad).unit for check in checks for grad in check.args[0]]
    set_flags = flags[: len(units)].tolist()
    bad = [unit for unit, flag in zip(units, set_flags, strict=True) if flag != 0]
    return list(dict.fromkeys(bad))


def nonfinite_error(units: list[str], rank: int, step: int) -> NonFiniteError:
    """The error of optimizer step ``step`` (1-based, skipped steps counted), naming the first
    of ``units`` (those whose gradient was not finite: :func:`nonfinite_units`, over a
    pipeline's ranks) and what state the step leaves."""
    bad = units or ["?"]
    more = f" (and {len(bad) - 1} more: {', '.join(map(repr, bad[1:]))})" if len(bad) > 1 else ""
    return NonFiniteError(
        f"rank {rank}, step {step}: the reduced gradient of unit {bad[0]!r} holds an inf or "
        f"NaN{more}. Nothing was updated: weights and optimizer state are as before this step, "
        "and its micro-batches were discarded (gradient accumulators zeroed), so the next call "
        "starts this step again; go on with other batches, or load a checkpoint. "
        "precision.on_nonfinite: skip skips such steps instead"
    )
