"""zerocc's own ops, registered with ``torch.library`` in the ``zerocc`` namespace.

Each op has an eager implementation and a fake (meta) one, so a scheduled graph stays printable,
runnable by fx, shape-propagatable on fake tensors, and lowerable by later backends.

Collectives come in start/wait pairs: ``*_start`` issues the collective on the active
:class:`~zerocc.comm.Comm` and returns its (not yet valid) result; ``wait`` blocks until it is
valid and returns it. Schemas carry alias annotations, so fx and the verifier know that ``wait``
returns its input and that ``all_reduce_start`` writes its argument.

The compute ops (``adamw_``, ``sgd_``, ``unscale_check_``, ``nonfinite_flags``, ``pack``) run
the kernel set made active by :func:`use_kernels` (``backend.kernels``: the torch reference or
fused Triton kernels, see :mod:`zerocc.backends.kernels`); the skip ranges of parameters the
loss does not reach are handled here, the same for every set.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import ModuleType

import torch
from torch.library import Library

from zerocc.backends.kernels import kernel_set
from zerocc.comm import Work, active_comm

DP_GROUP = "dp"  # name of the data-parallel group the collectives run on
_lib = Library("zerocc", "DEF")
_pending: dict[int, Work] = {}
_kernels: list[tuple[ModuleType, torch.device]] = []  # (kernel set, the step's device)
CPU = torch.device("cpu")

SCHEMAS = {
    "all_gather_start": "all_gather_start(Tensor shard, int world_size, str group) -> Tensor",
    "all_gather_into_start": (
        "all_gather_into_start(Tensor(a!) out, Tensor shard, str group) -> Tensor(a!)"
    ),
    "reduce_scatter_start": (
        "reduce_scatter_start(Tensor full, int world_size, str group) -> Tensor"
    ),
    "all_reduce_start": "all_reduce_start(Tensor(a!) tensor, str group) -> Tensor(a!)",
    "wait": "wait(Tensor(a) tensor) -> Tensor(a)",
    "free": "free(Tensor(a!) tensor) -> ()",
    "pack": "pack(Tensor?[] tensors, int[] numels, SymInt numel, ScalarType? dtype=None) -> Tensor",
    "unscale_check_": "unscale_check_(Tensor(a!)[] grads, Tensor inv_scale) -> Tensor",
    "sum_squares": "sum_squares(Tensor[] tensors, float scale) -> Tensor",
    "nonfinite_flags": "nonfinite_flags(Tensor[] grads, float scale, bool sum_squares) -> Tensor",
    "clip_coef": "clip_coef(Tensor total_sq, float max_norm) -> Tensor",
    "adamw_": (
        "adamw_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq,"
        " Tensor step, Tensor? grad_coef, Tensor? found_inf, Tensor(d!)? param_copy,"
        " float grad_scale, float lr, float beta1, float beta2, float eps, float weight_decay,"
        " int[] skip, bool sharded) -> ()"
    ),
    "sgd_": (
        "sgd_(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, Tensor? grad_coef,"
        " Tensor? found_inf, Tensor(d!)? param_copy, float grad_scale, float lr,"
        " float momentum, float weight_decay, int[] skip, bool sharded) -> ()"
    ),
}
COLLECTIVE_STARTS = (
    "all_gather_start",
    "all_gather_into_start",
    "reduce_scatter_start",
    "all_reduce_start",
)

for _schema in SCHEMAS.values():
    _lib.define(_schema)


def implements(name: str, lib: Library | None = None):
    """Decorator: ``fn`` is the eager implementation of ``zerocc.<name>`` (defined in ``lib``,
    by default this module's)."""

    def register(fn):
        (lib or _lib).impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def fake(name: str):
    """Decorator: ``fn`` is the fake (meta) implementation of ``zerocc.<name>``."""
    return torch.library.register_fake(f"zerocc::{name}")


def issue(result: torch.Tensor, work: Work) -> torch.Tensor:
    """Record ``work`` as in flight for ``result``, which ``zerocc.wait`` completes."""
    _pending[result.data_ptr()] = work
    return result


# --- collectives -------------------------------------------------------------------------


@implements("all_gather_start")
def _all_gather_start(shard: torch.Tensor, world_size: int, group: str) -> torch.Tensor:
    out = shard.new_empty(shard.numel() * world_size)
    return issue(out, active_comm().all_gather(out, shard))


@implements("all_gather_into_start")
def _all_gather_into_start(out: torch.Tensor, shard: torch.Tensor, group: str) -> torch.Tensor:
    return issue(out, active_comm().all_gather(out, shard))


@implements("reduce_scatter_start")
def _reduce_scatter_start(full: torch.Tensor, world_size: int, group: str) -> torch.Tensor:
    out = full.new_empty(full.numel() // world_size)
    return issue(out, active_comm().reduce_scatter(out, full))


@implements("all_reduce_start")
def _all_reduce_start(tensor: torch.Tensor, group: str) -> torch.Tensor:
    return issue(tensor, active_comm().all_reduce(tensor))


@implements("wait")
def _wait(tensor: torch.Tensor) -> torch.Tensor:
    work = _pending.pop(tensor.data_ptr(), None)
    if work is None:
        raise RuntimeError("zerocc.wait on a tensor with no collective in flight")
    began = time.perf_counter()
    work.wait()
    active_comm().stats.blocked_s += time.perf_counter() - began
    return tensor


@fake("all_gather_start")
def _(shard, world_size, group):
    return shard.new_empty(shard.numel() * world_size)


@fake("all_gather_into_start")
def _(out, shard, group):
    return out


@fake("reduce_scatter_start")
def _(full, world_size, group):
    return full.new_empty(full.numel() // world_size)


@fake("all_reduce_start")
def _(tensor, group):
    return tensor


@fake("wait")
def _(tensor):
    return tensor


def pending_collectives() -> int:
    """Collectives issued and not yet waited on (0 after every complete program run)."""
    return len(_pending)


def forget_pending() -> None:
    """Drop the handles of a program run that failed midway, so the next run starts clean."""
    _pending.clear()


# --- memory ------------------------------------------------------------------------------


@implements("free")
def _free(tensor: torch.Tensor) -> None:
    # Release the storage now, even if a stray reference would keep the tensor alive.
    tensor.untyped_storage().resize_(0)


@fake("free")
def _(tensor):
    return None


@implements("pack")
def _pack(
    tensors: list[torch.Tensor | None],
    numels: list[int],
    numel: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return active_kernels().pack(tensors, numels, numel, dtype)


@fake("pack")
def _(tensors, numels, numel, dtype=None):
    like = next(t for t in tensors if t is not None)
    return like.new_empty(numel, dtype=dtype or like.dtype)


@implements("unscale_check_")
def _unscale_check_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    return active_kernels().unscale_check_(grads, inv_scale)


@fake("unscale_check_")
def _(grads, inv_scale):
    return inv_scale.new_empty((), dtype=torch.float32)


@implements("nonfinite_flags")
def _nonfinite_flags(grads: list[torch.Tensor], scale: float, sum_squares: bool) -> torch.Tensor:
    return active_kernels().nonfinite_flags(grads, scale, sum_squares)


@fake("nonfinite_flags")
def _(grads, scale, sum_squares):
    return grads[0].new_empty(len(grads) + int(sum_squares), dtype=torch.float32)


# --- optimizer ---------------------------------------------------------------------------


@implements("sum_squares")
def _sum_squares(tensors: list[torch.Tensor], scale: float) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        total += (t.float() * scale).pow(2).sum()
    return total


@fake("sum_squares")
def _(tensors, scale):
    return tensors[0].new_empty((), dtype=torch.float32)


@implements("clip_coef")
def _clip_coef(total_sq: torch.Tensor, max_norm: float) -> torch.Tensor:
    # Same formula as torch.nn.utils.clip_grad_norm_.
    return (max_norm / (total_sq.sqrt() + 1e-6)).clamp(max=1.0)


@fake("clip_coef")
def _(total_sq, max_norm):
    return total_sq.new_empty(())


@contextlib.contextmanager
def _untouched(tensors: list[torch.Tensor | None], skip: list[int], sharded: bool):
    """Keep the ``skip`` ranges (flat offset, numel pairs, over the unit's whole flat buffer)
    of these tensors as they were: parameters the loss does not reach are not updated, as
    torch.optim skips a parameter whose ``grad`` is None."""
    tensors = [t for t in tensors if t is not None]
    size = tensors[0].numel()
    base = active_comm().rank * size if sharded else 0
    kept = []
    for offset, numel in zip(skip[::2], skip[1::2], strict=True):
        lo, hi = max(offset, base) - base, min(offset + numel, base + size) - base
        if lo < hi:
            kept.append((lo, hi, [t[lo:hi].clone() for t in tensors]))
    yield
    for lo, hi, copies in kept:
        for t, c in zip(tensors, copies, strict=True):
            t[lo:hi].copy_(c)


@implements("adamw_")
def _adamw_(*args) -> None:
    """AdamW on one flat shard (see :func:`zerocc.backends.kernels.reference.adamw_`)."""
    *update, skip, sharded = args
    param, _, exp_avg, exp_avg_sq, _, _, _, param_copy = update[:8]
    with _untouched([param, exp_avg, exp_avg_sq, param_copy], skip, sharded):
        _kernels_for(param).adamw_(*update)


@implements("sgd_")
def _sgd_(*args) -> None:
    """SGD on one flat shard (see :func:`zerocc.backends.kernels.reference.sgd_`)."""
    *update, skip, sharded = args
    param, _, momentum_buffer, _, _, param_copy = update[:6]
    with _untouched([param, momentum_buffer, param_copy], skip, sharded):
        _kernels_for(param).sgd_(*update)


@fake("adamw_")
def _(*args):
    return None


@fake("sgd_")
def _(*args):
    return None


def _kernels_for(param: torch.Tensor) -> ModuleType:
    """The update's kernels: an offloaded unit's update runs on the host while the step computes
    on a GPU, where the plan's Triton kernels do not run: the torch reference does there (on
    CPU it is vectorized and multi-threaded by ATen's intra-op pool). A step on the CPU keeps
    its plan's kernels, on a machine with a GPU too."""
    if param.device.type == "cpu" and _kernels and _kernels[-1][1].type == "cuda":
        return kernel_set("torch")
    return active_kernels()


@contextlib.contextmanager
def use_kernels(name: str, device: torch.device = CPU) -> Iterator[ModuleType]:
    """Run zerocc's compute ops (update, unscale, pack) with kernel set ``name`` in the body,
    for a step that computes on ``device``."""
    _kernels.append((kernel_set(name), device))
    try:
        yield _kernels[-1][0]
    finally:
        _kernels.pop()


def active_kernels() -> ModuleType:
    """The kernel set chosen by :func:`use_kernels`; the torch reference outside of one."""
    return _kernels[-1][0] if _kernels else kernel_set("torch")


def op(name: str) -> torch._ops.OpOverload:
    """The default overload of ``zerocc.<name>``."""
    return getattr(torch.ops.zerocc, name).default
