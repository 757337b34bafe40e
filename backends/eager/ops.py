"""The eager implementations of zerocc's ops: what each does when a program runs op by op.

Collectives run on the active :class:`~zerocc.runtime.comm.Comm` and offload copies on the
active :class:`~zerocc.runtime.transfers.Transfers` engine; ``zerocc.wait`` completes either.
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

from zerocc.ir.ops import CPU, implements
from zerocc.runtime.comm import Work, active_comm
from zerocc.runtime.transfers import active_transfers, new_on

_lib = Library("zerocc", "IMPL")
_pending: dict[int, Work] = {}
_kernels: list[tuple[ModuleType, torch.device]] = []  # (kernel set, the step's device)


def issue(result: torch.Tensor, work: Work) -> torch.Tensor:
    """Record ``work`` as in flight for ``result``, which ``zerocc.wait`` completes."""
    _pending[result.data_ptr()] = work
    return result


@implements("all_gather_start", _lib)
def _all_gather_start(shard: torch.Tensor, world_size: int, group: str) -> torch.Tensor:
    out = shard.new_empty(shard.numel() * world_size)
    return issue(out, active_comm().all_gather(out, shard))


@implements("all_gather_into_start", _lib)
def _all_gather_into_start(out: torch.Tensor, shard: torch.Tensor, group: str) -> torch.Tensor:
    return issue(out, active_comm().all_gather(out, shard))


@implements("reduce_scatter_start", _lib)
def _reduce_scatter_start(full: torch.Tensor, world_size: int, group: str) -> torch.Tensor:
    out = full.new_empty(full.numel() // world_size)
    return issue(out, active_comm().reduce_scatter(out, full))


@implements("all_reduce_start", _lib)
def _all_reduce_start(tensor: torch.Tensor, group: str) -> torch.Tensor:
    return issue(tensor, active_comm().all_reduce(tensor))


@implements("wait", _lib)
def _wait(tensor: torch.Tensor) -> torch.Tensor:
    work = _pending.pop(tensor.data_ptr(), None)
    if work is None:
        raise RuntimeError("zerocc.wait on a tensor with no collective in flight")
    began = time.perf_counter()
    work.wait()
    active_comm().stats.blocked_s += time.perf_counter() - began
    return tensor


def pending_collectives() -> int:
    """Collectives issued and not yet waited on (0 after every complete program run)."""
    return len(_pending)


def forget_pending() -> None:
    """Drop the handles of a program run that failed midway, so the next run starts clean."""
    _pending.clear()


@implements("free", _lib)
def _free(tensor: torch.Tensor) -> None:
    # Release the storage now, even if a stray reference would keep the tensor alive.
    tensor.untyped_storage().resize_(0)


@implements("pack", _lib)
def _pack(
    tensors: list[torch.Tensor | None],
    numels: list[int],
    numel: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return active_kernels().pack(tensors, numels, numel, dtype)


@implements("unscale_check_", _lib)
def _unscale_check_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    return active_kernels().unscale_check_(grads, inv_scale)


@implements("nonfinite_flags", _lib)
def _nonfinite_flags(grads: list[torch.Tensor], scale: float, sum_squares: bool) -> torch.Tensor:
    return active_kernels().nonfinite_flags(grads, scale, sum_squares)


@implements("sum_squares", _lib)
def _sum_squares(tensors: list[torch.Tensor], scale: float) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        total += (t.float() * scale).pow(2).sum()
    return total


@implements("clip_coef", _lib)
def _clip_coef(total_sq: torch.Tensor, max_norm: float) -> torch.Tensor:
    # Same formula as torch.nn.utils.clip_grad_norm_.
    return (max_norm / (total_sq.sqrt() + 1e-6)).clamp(max=1.0)


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


@implements("adamw_", _lib)
def _adamw_(*args) -> None:
    """AdamW on one flat shard (see :func:`zerocc.backends.kernels.reference.adamw_`)."""
    *update, skip, sharded = args
    param, _, exp_avg, exp_avg_sq, _, _, _, param_copy = update[:8]
    with _untouched([param, exp_avg, exp_avg_sq, param_copy], skip, sharded):
        _kernels_for(param).adamw_(*update)


@implements("sgd_", _lib)
def _sgd_(*args) -> None:
    """SGD on one flat shard (see :func:`zerocc.backends.kernels.reference.sgd_`)."""
    *update, skip, sharded = args
    param, _, momentum_buffer, _, _, param_copy = update[:6]
    with _untouched([param, momentum_buffer, param_copy], skip, sharded):
        _kernels_for(param).sgd_(*update)


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


@implements("copy_start", _lib)
def _copy_start(src: torch.Tensor, device: torch.device, direction: str) -> torch.Tensor:
    out = new_on(device, src.shape, src.dtype, src)
    return issue(out, active_transfers().copy(out, src, direction))


@implements("copy_into_start", _lib)
def _copy_into_start(dst: torch.Tensor, src: torch.Tensor, direction: str) -> torch.Tensor:
    return issue(dst, active_transfers().copy(dst, src, direction))


@implements("nvme_read_start", _lib)
def _nvme_read_start(
    key: str, shape: list[int], dtype: torch.dtype, device: torch.device, direction: str
) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    return issue(out, active_transfers().read(key, out, direction))


@implements("nvme_write_start", _lib)
def _nvme_write_start(src: torch.Tensor, key: str, direction: str) -> torch.Tensor:
    return issue(src, active_transfers().write(key, src, direction))
