"""What the plan's backend makes of a compiled program, without running it.

``zerocc inspect PLAN --lowered [DIR]`` lowers the program that steps with the plan's backend,
bound to a runtime context of simulated ranks (nothing communicates: lowering runs nothing), and
reports what the backend says of it: for Inductor, each compute region with its phase, ops,
compile time and whether it compiled, and the code it generated.
"""

from __future__ import annotations

import torch

from zerocc.backends import Executable, get_backend
from zerocc.backends.kernels import kernel_set
from zerocc.inspect.estimate import Inspection
from zerocc.ir.nodes import placeholders, val
from zerocc.runtime.comm import FakeComm
from zerocc.runtime.context import RuntimeContext
from zerocc.runtime.transfers import Transfers


def lower(inspection: Inspection) -> Executable:
    """The executable the plan's backend makes of the stepping program (on its fake inputs)."""
    plan, program = inspection.plan, inspection.stepping.gm
    example = [val(n) for n in placeholders(program)]
    device = next(v.device for v in example if isinstance(v, torch.Tensor))
    context = RuntimeContext(
        FakeComm(inspection.world_size),
        Transfers(device=device),
        kernel_set(plan.backend.kernels),
        device,
    )
    return get_backend(plan.backend.name)(program, example, context)
