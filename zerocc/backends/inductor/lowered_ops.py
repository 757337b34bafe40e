"""zerocc's ops in the form one Inductor graph can hold: the ``zerocc_lowered`` namespace.

The whole-graph lowering (:mod:`zerocc.backends.inductor.whole`) hands Inductor the entire
program, zerocc's ops included. Inductor functionalizes what it is given, and it accepts a
custom op that mutates arguments but not one that returns an alias of one (zerocc's ``wait``,
``all_reduce_start``, ``all_gather_into_start``, ``copy_into_start`` do). So each zerocc op
has a twin here:

- the compute ops (``pack``, the update, the flags, the clip) keep their schemas; the
  non-finite checks are made of torch ops, which Inductor compiles (:data:`COMPOSITE`);
- a start names its start node (``started``, the eager backend's handle key); one that fills
  an existing tensor returns nothing and mutates it; one that makes its result returns it;
- an update on the host stream (an offload's deferred update) names its node, as a start
  does, and is issued to the host's worker; ``host_wait`` is lowered as ``wait`` is;
- ``wait(tensor, reads, started)`` returns nothing (an op returning its input is what
  AOTAutograd's aliasing check rejects, torch's own ``wait_tensor`` excepted): what read the
  wait's result reads ``tensor``, and the wait is lowered as torch's is, a kernel that
  *mutates* ``tensor`` (Inductor's ``_WaitKernel``), so every later read of it comes after the
  wait, and Inductor never reuses its memory while the collective or copy may still write it
  (Inductor's own model of a collective). ``reads`` are the tensors a filling start reads (an
  all-gather's shard, a copy's source): read by the wait too, Inductor keeps them, unchanged,
  until it. A making start's are kept so by Inductor's collective kernel itself.

At run time every twin calls the implementation of the executable running it: its
:class:`~zerocc.backends.eager.ops.EagerOps`, made current by :func:`running` for the length
of a call (the generated code calls ops by name and holds no reference to an executable).
``free`` has no twin: Inductor frees each buffer after its last read, which is where the
passes put the frees.

Inductor's on-disk caches know a twin by its name and schema, not by what it does: a change to
what one computes must come with a new name, or a second launch would run the old one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.library import Library

from zerocc.backends.eager.ops import EagerOps
from zerocc.backends.kernels import reference
from zerocc.ir.ops import SCHEMAS

NAMESPACE = "zerocc_lowered"
_lib = Library(NAMESPACE, "DEF")

# Starts that make their result; starts that fill an existing tensor (mutated, nothing
# returned); the ops whose schema is zerocc's own.
MAKING_STARTS = {
    "all_gather_start": "all_gather_start(Tensor shard, int world_size, str group, str started)"
    " -> Tensor",
    "all_gather_quantized_start": (
        "all_gather_quantized_start(Tensor shard, int world_size, int block, str wire, "
        "str group, str started) -> Tensor"
    ),
    "reduce_scatter_start": (
        "reduce_scatter_start(Tensor full, int world_size, str group, str started) -> Tensor"
    ),
    "reduce_scatter_quantized_start": (
        "reduce_scatter_quantized_start(Tensor full, int world_size, int block, str wire, "
        "str group, str started) -> Tensor"
    ),
    "copy_start": "copy_start(Tensor src, Device device, str direction, str started) -> Tensor",
    "all_to_all_start": "all_to_all_start(Tensor tensor, str group, str started) -> Tensor",
    "all_to_all_experts_start": (
        "all_to_all_experts_start(Tensor rows, Tensor sent, Tensor got, str into, str group, "
        "str started) -> Tensor"
    ),
    "all_to_all_tokens_start": (
        "all_to_all_tokens_start(Tensor ticket, Tensor sent, Tensor got, SymInt[] shape, "
        "ScalarType dtype, str take, str group, str started) -> Tensor"
    ),
}
FILLING_STARTS = {
    "all_gather_into_start": (
        "all_gather_into_start(Tensor(a!) out, Tensor shard, str group, str started) -> ()"
    ),
    "all_reduce_start": "all_reduce_start(Tensor(a!) tensor, str group, str started) -> ()",
    "copy_into_start": (
        "copy_into_start(Tensor(a!) dst, Tensor src, str direction, str started) -> ()"
    ),
}
COMPUTE = (
    "pack", "unscale_check_", "sum_squares", "clip_coef", "adamw_", "sgd_",
    "optim_update_",  # (the other optimizers': torch's functional forms, run as in eager)
    "group_rank", "sum_squares_tp",  # (tensor parallelism's)
    "host_buffer",  # (offload's staging)
    "experts_forward", "experts_backward",  # (expert parallelism's, on the rows received)
)  # fmt: skip
# Twins made of torch ops (the torch reference's), which Inductor traces and compiles: the
# non-finite checks (and the clip's sum of squares), one fused pass over the gradients, 7 ms
# against the reference's 71 for 11 shards of 1.6M elements on one core of this CPU. The
# others run as their kernel set does: the packing among them, a memcpy per gradient, where
# Inductor's concatenation took 3x as long.
COMPOSITE = {"nonfinite_flags": reference.nonfinite_flags}
WAIT = "wait(Tensor tensor, Tensor[] reads, str started) -> ()"
# A host-stream update (offload.defer_updates) is issued to the host's worker: the update's twin
# names its node, as a start does; ``host_wait`` is lowered as ``wait`` is.
HOST_UPDATES = {
    f"host_{name}": SCHEMAS[name]
    .replace(name, f"host_{name}", 1)
    .replace(") -> ()", ", str started) -> ()")
    for name in ("adamw_", "sgd_", "optim_update_")
}
HOST_WAIT = "host_wait(Tensor tensor, Tensor[] reads, str started) -> ()"

# Every zerocc op the whole graph can hold: the twins, and ``free``, which it drops.
LOWERED = frozenset({*MAKING_STARTS, *FILLING_STARTS, *COMPUTE, *COMPOSITE, "wait", "host_wait"})
DROPPED = frozenset({"free"})

_running: contextvars.ContextVar[EagerOps] = contextvars.ContextVar("zerocc_lowered_ops")


@contextlib.contextmanager
def running(ops: EagerOps) -> Iterator[None]:
    """The twins called in the body run ``ops``' implementations."""
    token = _running.set(ops)
    try:
        yield
    finally:
        _running.reset(token)


def _current() -> EagerOps:
    ops = _running.get(None)
    if ops is None:
        raise RuntimeError(f"{NAMESPACE} ops run only inside a zerocc executable's call")
    return ops


def _start(name: str, returns: bool):
    def impl(*args: Any) -> torch.Tensor | None:
        *args, started = args
        out = getattr(_current(), name)(*args, started=started)
        return out if returns else None

    def fake(*args: Any) -> torch.Tensor | None:
        return getattr(torch.ops.zerocc, name)(*args[:-1]) if returns else None

    return impl, fake


def _compute(name: str):
    def impl(*args: Any) -> Any:
        return getattr(_current(), name)(*args)

    def fake(*args: Any) -> Any:
        return getattr(torch.ops.zerocc, name)(*args)

    return impl, fake


def _wait_impl(tensor: torch.Tensor, reads: list[torch.Tensor], started: str) -> None:
    _current().wait(tensor, started=started)


def _host_wait_impl(tensor: torch.Tensor, reads: list[torch.Tensor], started: str) -> None:
    _current().host_wait(tensor, started)


def _wait_fake(tensor: torch.Tensor, reads: list[torch.Tensor], started: str) -> None:
    return None


def _host_update(name: str):
    def impl(*args: Any) -> None:
        *args, started = args
        getattr(_current(), name)(*args, started=started)

    def fake(*args: Any) -> None:
        return None

    return impl, fake


def _define(name: str, schema: str, impl: Any, fake: Any) -> None:
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", lib=_lib)(fake)


for _name, _schema in MAKING_STARTS.items():
    _define(_name, _schema, *_start(_name, returns=True))
for _name, _schema in FILLING_STARTS.items():
    _define(_name, _schema, *_start(_name, returns=False))
for _name in COMPUTE:
    _define(_name, SCHEMAS[_name], *_compute(_name))
for _name, _composite in COMPOSITE.items():
    _lib.define(SCHEMAS[_name])
    _lib.impl(_name, _composite, "CompositeImplicitAutograd")
for _name, _schema in HOST_UPDATES.items():
    _define(_name, _schema, *_host_update(_name.removeprefix("host_")))
_define("wait", WAIT, _wait_impl, _wait_fake)
_define("host_wait", HOST_WAIT, _host_wait_impl, _wait_fake)
# A wait returns nothing: kept from fx's dead-code elimination, as torch's collectives are.
torch.fx.node.has_side_effect(getattr(torch.ops, NAMESPACE).wait.default)
torch.fx.node.has_side_effect(getattr(torch.ops, NAMESPACE).host_wait.default)


def lowered(name: str) -> torch._ops.OpOverload:
    """The twin of ``zerocc.<name>``."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


@functools.cache
def register_lowerings() -> None:
    """Teach Inductor the twins that communicate or copy (once per process): a making start
    is an out-of-place collective kernel, ``wait`` a kernel that mutates what it waits for.
    The rest are fallback kernels, which Inductor makes of any op it has no lowering for."""
    from torch._inductor import ir
    from torch._inductor.lowering import (
        add_layout_constraint,
        constrain_to_fx_strides,
        register_lowering,
    )
    from torch._inductor.virtualized import V

    class Wait(ir._WaitKernel):
        """Inductor's wait kernel, for a wait that names its start (and calls zerocc's wait,
        not the C++ kernel of torch's, which Inductor's names for a C++ wrapper)."""

        def __init__(self, layout: Any, kernel: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(layout, kernel, *args, **kwargs)
            self.set_cpp_kernel_name()  # its own schema name

        @classmethod
        def create_named(cls, kernel: Any, inp: Any, reads: list, started: str) -> None:
            with V.graph.fake_mode:
                made = cls.process_kernel(kernel, inp, reads, started)
            _, tensors, non_tensors, unflatten, _ = made
            device = inp.get_device()
            packed = cls(ir.NoneLayout(device=device), kernel, tensors, non_tensors, unflatten)
            packed.mutation_outputs.append(
                ir.MutationOutput(ir.NoneLayout(device=device), inp, packed)
            )

    for name in MAKING_STARTS:
        op = getattr(getattr(torch.ops, NAMESPACE), name)
        add_layout_constraint(op, constrain_to_fx_strides)

        def lower_start(inp: Any, *args: Any, _op: Any = op.default) -> Any:
            return ir.TensorBox.create(ir._CollectiveKernel.create_out_of_place(_op, inp, *args))

        # (no type promotion: expert parallelism's starts read int64 counts beside the rows)
        register_lowering(op, type_promotion_kind=None)(lower_start)

    for name in ("wait", "host_wait"):
        op = getattr(getattr(torch.ops, NAMESPACE), name)

        def lower_wait(inp: Any, reads: list, started: str, _op: Any = op.default) -> None:
            Wait.create_named(_op, inp, reads, started)

        register_lowering(op, type_promotion_kind=None)(lower_wait)
