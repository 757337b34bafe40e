"""What the plan's backend makes of a compiled program, without running it.

``zerocc inspect PLAN --lowered [DIR]`` lowers the program that steps with the plan's backend,
bound to a runtime context of simulated ranks (nothing communicates: lowering runs nothing), and
reports what the backend says of it: for Inductor, each compute region with its phase, ops,
compile time and whether it compiled, and the code it generated.
"""

from __future__ import annotations

import torch

from zerocc.backends import Executable, get_backend, resolve_backend
from zerocc.backends.kernels import kernel_set, resolve_kernels
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import FakeComm
from zerocc.engine.transfers import Transfers
from zerocc.inspect.estimate import Inspection
from zerocc.ir.nodes import placeholders, val


def lower(inspection: Inspection) -> tuple[str, Executable]:
    """The plan's backend (``auto`` resolved for the program's device) and the executable it
    makes of the stepping program (on its fake inputs)."""
    plan, program = inspection.plan, inspection.stepping.gm
    example = [val(n) for n in placeholders(program)]
    device = next(v.device for v in example if isinstance(v, torch.Tensor))
    context = RuntimeContext(
        FakeComm(inspection.world_size),
        Transfers(device=device),
        kernel_set(resolve_kernels(plan.backend.kernels, device, plan.precision.master)),
        device,
    )
    name = resolve_backend(plan.backend.name, device)
    return name, get_backend(name)(program, example, context)
