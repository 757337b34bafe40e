"""The step's non-finite check split into one check per gradient, each right after its gradient
is complete (the offload pass: an offloaded gradient leaves the device once complete, and
nothing may read it there afterwards)."""

from __future__ import annotations

import torch
from torch import fx

from zerocc.ir.access import last_writes
from zerocc.ir.nodes import comes_after, emit, info, op_name
from zerocc.ir.ops import op

aten = torch.ops.aten


def check_gradients_as_they_complete(gm: fx.GraphModule) -> bool:
    """Split the step's non-finite check (with the clip's squared norm, read in the same
    pass) into one check per gradient, right after that gradient is complete, and combine
    their results where the check was; False when there is no such check (loss scaling
    checks as it unscales, in place, after backward). Then nothing reads an offloaded
    gradient on the device after its copy to the host has begun. The combination adds the
    squared norms in the check's order, one after the other as the check does: the same
    numbers, bit for bit."""
    check = next((n for n in gm.graph.nodes if op_name(n.target) == "zerocc.nonfinite_flags"), None)
    if check is None:
        return False
    grads, scale, clip = check.args
    last = last_writes(gm, grads, check)
    partials: list[fx.Node] = []
    for grad in grads:
        after = last[grad]
        if partials and comes_after(partials[-1], after):
            after = partials[-1]  # in the check's order, as nonfinite_units reads them
        with gm.graph.inserting_after(after):
            partials.append(
                emit(
                    gm.graph,
                    op("nonfinite_flags"),
                    ([grad], scale, clip),
                    unit=info(grad).unit,
                    phase=info(after).phase,
                    note=f"{info(grad).unit}'s part of the step's non-finite check, once "
                    "its gradient is complete",
                )
            )
    where = {"phase": info(check).phase}
    with gm.graph.inserting_before(check):
        parts = [emit(gm.graph, aten.slice.Tensor, (p, 0, 0, 1), **where) for p in partials]
        if clip:
            squares = [emit(gm.graph, aten.slice.Tensor, (p, 0, 1, 2), **where) for p in partials]
            total = squares[0]
            for square in squares[1:]:
                total = emit(gm.graph, aten.add.Tensor, (total, square), **where)
            parts.append(total)
        combined = emit(gm.graph, aten.cat.default, (parts,), note=info(check).note, **where)
    check.replace_all_uses_with(combined)
    gm.graph.erase_node(check)
    return True
