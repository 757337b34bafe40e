"""zerocc: a compiler for sharded data-parallel training (ZeRO 0-3 / FSDP) in PyTorch.

step = zerocc.compile(model, "plan.yaml")
loss = step(*batch)
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from zerocc.errors import (
    BatchError,
    CaptureError,
    DataExhaustedError,
    DeviceError,
    InvariantError,
    LoweringWarning,
    NotSupportedError,
    PassOrderError,
    PlanError,
    RankMismatchError,
    RankStoppedError,
    ZeroccError,
)

if TYPE_CHECKING:
    from torch import nn

    from zerocc.compiler.capture import LossFn
    from zerocc.compiler.materialize import materialize
    from zerocc.compiler.plan import Plan, load_plan
    from zerocc.compiler.workload import Workload, load_workload, plan_relative
    from zerocc.engine.comm import Comm, FakeComm
    from zerocc.ir.keyed_draws import keyed_draws
    from zerocc.runtime.checkpoint.weight_files import weights_from
    from zerocc.train_step import TrainStep

# The API's names and their modules, imported as they are first read (PEP 562): `import zerocc`
# and the command line's `--help` need no torch (issue 80).
_LAZY = {
    "FakeComm": "zerocc.engine.comm",
    "Plan": "zerocc.compiler.plan",
    "TrainStep": "zerocc.train_step",
    "Workload": "zerocc.compiler.workload",
    "keyed_draws": "zerocc.ir.keyed_draws",
    "load_plan": "zerocc.compiler.plan",
    "load_workload": "zerocc.compiler.workload",
    "materialize": "zerocc.compiler.materialize",
    "plan_relative": "zerocc.compiler.workload",
    "weights_from": "zerocc.runtime.checkpoint.weight_files",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zerocc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BatchError",
    "CaptureError",
    "DataExhaustedError",
    "DeviceError",
    "FakeComm",
    "InvariantError",
    "LoweringWarning",
    "NotSupportedError",
    "PassOrderError",
    "Plan",
    "PlanError",
    "RankMismatchError",
    "RankStoppedError",
    "TrainStep",
    "Workload",
    "ZeroccError",
    "compile",
    "keyed_draws",
    "load_plan",
    "load_workload",
    "materialize",
    "plan_relative",
    "weights_from",
]
__version__ = "0.1.0"


def compile(
    model: nn.Module,
    plan: str | os.PathLike | dict | Plan,
    loss_fn: LossFn | None = None,
    *,
    comm: Comm | None = None,
    auto: bool = False,
    example: Any = None,
) -> TrainStep:
    """Compile the training step of ``model`` under ``plan`` (a YAML path, a dict or a Plan):
    a :class:`~zerocc.train_step.TrainStep` under every plan (a pipeline's, ``parallel.pp`` >
    1, walks its rank's schedule of stage actions: :mod:`zerocc.runtime.pipeline_rank`).

    ``loss_fn(model, *batch) -> scalar`` defaults to ``model(*batch)`` (or its ``.loss``).
    The step's semantics are DDP's: every rank passes its own micro-batch, the gradient is the
    mean over ranks (and micro-batches). ``comm`` overrides the process group, e.g.
    ``zerocc.FakeComm(world_size=8)`` to build and run programs for 8 simulated ranks.
    Programs are built on the first call of each batch signature.

    ``plan="auto"`` (or ``auto=True`` beside a plan whose fields are kept) searches the plan
    as `zerocc plan auto` does, for this run's ranks and device, on ``example`` (one
    micro-batch as the step takes it); rank 0 prints the candidates and the choice
    (:mod:`zerocc.inspect.plan_auto`). ``step.plan`` is the plan chosen.
    """
    import torch.distributed as dist

    from zerocc.compiler.plan import load_plan
    from zerocc.engine.comm import comm_from_environment
    from zerocc.inspect.plan_auto import searched_plan
    from zerocc.runtime.devices import join_default_group, rank_device, use_device
    from zerocc.train_step import TrainStep

    named_auto = isinstance(plan, str) and plan == "auto"
    auto = auto or named_auto
    plan = load_plan({} if named_auto else plan)
    device = rank_device(plan)  # checked before anything touches CUDA
    use_device(device)
    made_comm = comm is None
    if comm is None:
        join_default_group(device)
        _check_world_size(plan, dist.get_world_size() if dist.is_initialized() else 1)
        comm = comm_from_environment(plan.backend.timeout_s, device)
    _check_world_size(plan, comm.world_size)
    try:
        if auto:
            plan, _ = searched_plan(model, plan, loss_fn, example, comm, device)
        return TrainStep(model, plan, loss_fn, comm, device)
    except BaseException:
        if made_comm:
            comm.close()  # the group made for this step dies with it
        raise


def _check_world_size(plan: Plan, world_size: int) -> None:
    expected = plan.zero.world_size
    if expected is not None and expected != world_size:
        raise PlanError(
            f"zero.world_size: the plan expects {expected} ranks, but this run has "
            f"{world_size}; launch {expected} ranks or change zero.world_size"
        )
