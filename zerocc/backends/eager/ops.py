"""What zerocc's ops do when a program runs op by op: the eager backend's implementations.

One :class:`EagerOps` per executable, bound to its runtime context: collectives run on the
context's comm (on the group of the mesh each names), offload copies on its copy engine, the
compute ops (``adamw_``, ``sgd_``, ``unscale_check_``, ``nonfinite_flags``, ``pack``) with its
kernel set (``backend.kernels``: the torch reference or fused Triton kernels, see
:mod:`zerocc.backends.kernels`); the other optimizers' ``optim_update_`` with torch's functional
forms (:mod:`zerocc.backends.kernels.torch_optim`), whatever the kernel set. What is in flight
is the executable's: each start's handle, keyed by the start node's name, until the wait that
names it. The rows expert parallelism's exchanges receive are the context's (its payloads,
shared by a pipeline stage's programs). The skip ranges of parameters the loss does not reach
are handled here, the same for every kernel set.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from zerocc.backends.kernels import host_kernels, kernel_set, reference, torch_optim
from zerocc.engine import RuntimeContext
from zerocc.engine.comm import Work
from zerocc.engine.kernel_set import AdamWHyper, KernelSet
from zerocc.engine.quantized import all_gather_quantized, reduce_scatter_quantized
from zerocc.ir import expert_calls
from zerocc.ir.expert_calls import results_grad_key, results_key, rows_grad_key, rows_key
from zerocc.ir.ops import TO_HOST
from zerocc.ir.wire import wire_format


class EagerOps:
    """zerocc's ops for one executable. A start op takes ``started`` (its node's name), and the
    ``wait`` that completes it names the same start."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.in_flight: dict[str, Work] = {}
        # The last found_inf flag copied where the kernels read it: (the flag, its version, copy).
        self._host_flag: tuple[weakref.ref, int, torch.Tensor] | None = None

    def _issue(self, started: str, result: torch.Tensor, work: Work) -> torch.Tensor:
        self.in_flight[started] = work
        return result

    # -- collectives ------------------------------------------------------------------------

    def all_gather_start(
        self, shard: torch.Tensor, world_size: int, group: str, *, started: str
    ) -> torch.Tensor:
        out = shard.new_empty(shard.numel() * world_size)
        return self._issue(started, out, self.ctx.comm.on(group).all_gather(out, shard))

    def all_gather_quantized_start(
        self,
        shard: torch.Tensor,
        world_size: int,
        block: int,
        wire: str,
        group: str,
        *,
        started: str,
    ) -> torch.Tensor:
        comm, how = self.ctx.comm.on(group), wire_format(wire)
        out, work = all_gather_quantized(comm, shard, world_size, block, how)
        return self._issue(started, out, work)

    def all_gather_into_start(
        self, out: torch.Tensor, shard: torch.Tensor, group: str, *, started: str
    ) -> torch.Tensor:
        return self._issue(started, out, self.ctx.comm.on(group).all_gather(out, shard))

    def reduce_scatter_start(
        self, full: torch.Tensor, world_size: int, group: str, *, started: str
    ) -> torch.Tensor:
        out = full.new_empty(full.numel() // world_size)
        return self._issue(started, out, self.ctx.comm.on(group).reduce_scatter(out, full))

    def reduce_scatter_quantized_start(
        self,
        full: torch.Tensor,
        world_size: int,
        block: int,
        wire: str,
        group: str,
        *,
        started: str,
    ) -> torch.Tensor:
        comm, how = self.ctx.comm.on(group), wire_format(wire)
        out, work = reduce_scatter_quantized(comm, full, world_size, block, how)
        return self._issue(started, out, work)

    def all_reduce_start(self, tensor: torch.Tensor, group: str, *, started: str) -> torch.Tensor:
        return self._issue(started, tensor, self.ctx.comm.on(group).all_reduce(tensor))

    # -- expert parallelism's exchanges (their rows kept in the context's payloads) -------------

    def all_to_all_start(self, tensor: torch.Tensor, group: str, *, started: str) -> torch.Tensor:
        comm = self.ctx.comm.on(group)
        out, each = torch.empty_like(tensor), [len(tensor) // comm.world_size] * comm.world_size
        return self._issue(started, out, comm.all_to_all(out, tensor, each, each))

    def all_to_all_experts_start(
        self,
        rows: torch.Tensor,
        sent: torch.Tensor,
        got: torch.Tensor,
        into: str,
        group: str,
        *,
        started: str,
    ) -> torch.Tensor:
        """Each row to the rank holding its expert; what arrives kept under ``into``."""
        comm = self.ctx.comm.on(group)
        to_each, from_each = _per_rank(sent, comm.world_size), _per_rank(got, comm.world_size)
        out = rows.new_empty((sum(from_each), *rows.shape[1:]))
        work = comm.all_to_all(out, rows.contiguous(), from_each, to_each)
        self.ctx.payloads.put(into, out)
        return self._issue(started, rows.new_zeros((1,)), work)

    def all_to_all_tokens_start(
        self,
        ticket: torch.Tensor,
        sent: torch.Tensor,
        got: torch.Tensor,
        shape: list[int],
        dtype: torch.dtype,
        take: str,
        group: str,
        *,
        started: str,
    ) -> torch.Tensor:
        """The rows kept under ``take`` back to the ranks their tokens are on, in the order
        those ranks sent them."""
        comm = self.ctx.comm.on(group)
        to_each, from_each = _per_rank(got, comm.world_size), _per_rank(sent, comm.world_size)
        rows = self.ctx.payloads.take(take).to(dtype)
        out = torch.empty(tuple(shape), dtype=dtype, device=ticket.device)
        work = comm.all_to_all(out, rows.contiguous(), from_each, to_each)
        return self._issue(started, out, work)

    def experts_forward(
        self,
        ticket: torch.Tensor,
        got: torch.Tensor,
        state: list[torch.Tensor],
        keep: bool,
        call: str,
    ) -> torch.Tensor:
        payloads = self.ctx.payloads
        rows = payloads.newest(rows_key(call)) if keep else payloads.take(rows_key(call))
        results = expert_calls.experts_forward(call, rows, got, state)
        payloads.put(results_key(call), results)
        return torch.zeros_like(ticket)

    def experts_backward(
        self,
        ticket: torch.Tensor,
        got: torch.Tensor,
        state: list[torch.Tensor],
        rows_grad: bool,
        call: str,
    ) -> list[torch.Tensor]:
        rows = self.ctx.payloads.take(rows_key(call))
        grad = self.ctx.payloads.take(results_grad_key(call))
        found, state_grads = expert_calls.experts_backward(call, rows, got, state, grad)
        if rows_grad:  # (sent back next; not when what the call was given takes no gradient)
            self.ctx.payloads.put(rows_grad_key(call), found)
        return [torch.zeros_like(ticket), *state_grads]

    def wait(self, tensor: torch.Tensor, *, started: str) -> torch.Tensor:
        work = self.in_flight.pop(started, None)
        if work is None:
            raise RuntimeError(f"zerocc.wait on {started!r}, which has nothing in flight")
        began = time.perf_counter()
        work.wait()
        self.ctx.comm.stats.blocked_s += time.perf_counter() - began
        return tensor

    # -- offload copies ---------------------------------------------------------------------

    def copy_start(
        self, src: torch.Tensor, device: torch.device, direction: str, *, started: str
    ) -> torch.Tensor:
        key = started if direction == TO_HOST else None  # a host buffer, reused every step
        out = self.ctx.transfers.empty(device, src.shape, src.dtype, src, key)
        return self._issue(started, out, self.ctx.transfers.copy(out, src, direction))

    def copy_into_start(
        self, dst: torch.Tensor, src: torch.Tensor, direction: str, *, started: str
    ) -> torch.Tensor:
        return self._issue(started, dst, self.ctx.transfers.copy(dst, src, direction))

    def nvme_read_start(
        self,
        key: str,
        shape: list[int],
        dtype: torch.dtype,
        device: torch.device,
        direction: str,
        *,
        started: str,
    ) -> torch.Tensor:
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        return self._issue(started, out, self.ctx.transfers.read(key, out, direction))

    def nvme_write_start(
        self, src: torch.Tensor, key: str, direction: str, *, started: str
    ) -> torch.Tensor:
        return self._issue(started, src, self.ctx.transfers.write(key, src, direction))

    # -- memory -----------------------------------------------------------------------------

    def host_buffer(self, numel: int, dtype: torch.dtype, key: str) -> torch.Tensor:
        """The host buffer of ``key``: the same every step (the copy engine's host buffers)."""
        return self.ctx.transfers.host_buffers.get(key, (numel,), dtype)

    def free(self, tensor: torch.Tensor) -> None:
        # Release the storage now, even if a stray reference would keep the tensor alive.
        tensor.untyped_storage().resize_(0)

    def pack(
        self,
        tensors: list[torch.Tensor | None],
        numels: list[int],
        numel: int,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self.ctx.kernels.pack(tensors, numels, numel, dtype)

    # -- gradients and the optimizer --------------------------------------------------------

    def unscale_check_(self, grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
        return self.ctx.kernels.unscale_check_(grads, inv_scale)

    def nonfinite_flags(
        self, grads: list[torch.Tensor], scale: float, sum_squares: bool
    ) -> torch.Tensor:
        return self.ctx.kernels.nonfinite_flags(grads, scale, sum_squares)

    def sum_squares(self, tensors: list[torch.Tensor], scale: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
        for t in tensors:
            total += (t.float() * scale).pow(2).sum()
        return total

    def sum_squares_tp(
        self,
        grad: torch.Tensor,
        scale: float,
        shared: list[int],
        parts: int,
        shard_group: str | None,
    ) -> torch.Tensor:
        """The squared norm of ``grad * scale``, the ``shared`` ranges counting 1/parts (see
        the op's schema in :mod:`zerocc.ir.ops`)."""
        size = grad.numel()
        cuts, lo = [], 0  # (start, end, weight) pieces covering the tensor, in order
        for start, end in sorted(self._in_this_tensor(shared, size, shard_group)):
            cuts += [(lo, start, 1.0), (start, end, 1.0 / parts)]
            lo = end
        cuts.append((lo, size, 1.0))
        total = torch.zeros((), dtype=torch.float32, device=grad.device)
        flat = grad.reshape(-1)
        for start, end, weight in cuts:
            if start < end:
                total += (flat[start:end].float() * scale).pow(2).sum() * weight
        return total

    def group_rank(self, like: torch.Tensor, group: str) -> torch.Tensor:
        """This rank's index in ``group``, as a tensor on ``like``'s device."""
        return torch.tensor(self.ctx.comm.on(group).rank, dtype=torch.int64, device=like.device)

    def clip_coef(self, total_sq: torch.Tensor, max_norm: float) -> torch.Tensor:
        # Same formula as torch.nn.utils.clip_grad_norm_.
        return (max_norm / (total_sq.sqrt() + 1e-6)).clamp(max=1.0)

    def adamw_(self, *args, started: str | None = None) -> None:
        """AdamW on one flat shard (see :func:`zerocc.backends.kernels.reference.adamw_`);
        ``started``: an update on the host stream, issued to the host's worker (the
        ``host_wait`` naming it completes it)."""
        self._update(self._adamw, args, started)

    def sgd_(self, *args, started: str | None = None) -> None:
        """SGD on one flat shard (see :func:`zerocc.backends.kernels.reference.sgd_`)."""
        self._update(self._sgd, args, started)

    def optim_update_(self, *args, started: str | None = None) -> None:
        """Any other optimizer of the plan's registry on one flat shard (see
        :func:`zerocc.backends.kernels.torch_optim.optim_update_`)."""
        self._update(self._optim_update, args, started)

    def _update(self, run: Callable[[tuple], None], args: tuple, started: str | None) -> None:
        if started is None:
            run(args)
        else:
            self.in_flight[started] = self.ctx.host.submit(lambda: run(args))

    def host_wait(self, tensor: torch.Tensor, update: str) -> torch.Tensor:
        """``tensor`` once the host update issued as ``update`` is done."""
        work = self.in_flight.pop(update, None)
        if work is None:
            raise RuntimeError(f"zerocc.host_wait on {update!r}, which has nothing in flight")
        work.wait()
        return tensor

    def _adamw(self, args: tuple) -> None:
        *update, skip, shard_group = args
        tensors, (grad_scale, lr, beta1, beta2, eps, weight_decay) = update[:8], update[8:]
        param, _, exp_avg, exp_avg_sq, _, _, found_inf, param_copy = tensors
        kernels = self.kernels_for(param)
        tensors[6] = self._flag_for(kernels, found_inf, param)
        hyper = AdamWHyper(
            lr=float(lr),  # the schedule's rate: a 0-dim tensor on the CPU, no sync
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
        )  # fmt: skip
        with self._untouched([param, exp_avg, exp_avg_sq], param_copy, skip, shard_group):
            kernels.adamw_(*tensors, hyper)

    def _sgd(self, args: tuple) -> None:
        *update, skip, shard_group = args
        param, _, momentum_buffer, _, found_inf, param_copy, _, lr = update[:8]
        kernels = self.kernels_for(param)
        update[4] = self._flag_for(kernels, found_inf, param)
        update[7] = float(lr)
        with self._untouched([param, momentum_buffer], param_copy, skip, shard_group):
            kernels.sgd_(*update)

    def _optim_update(self, args: tuple) -> None:
        param, grad, *states = args[:5]
        step, grad_coef, found_inf, param_copy, grad_scale, lr, name, hyper, skip, group = args[5:]
        found_inf = self._flag_for(reference, found_inf, param)  # (read on the host, as there)
        with self._untouched([param, *states], param_copy, skip, group):
            torch_optim.optim_update_(
                param, grad, states, step, grad_coef, found_inf, param_copy, grad_scale,
                float(lr), name, hyper,
            )  # fmt: skip

    def kernels_for(self, param: torch.Tensor) -> KernelSet:
        """The update's kernels: an offloaded unit's update runs on the host while the step
        computes on a GPU, where the plan's Triton kernels do not run: the one-pass loop does
        there (the update, its scaling and its copy compiled into one multi-threaded pass),
        or torch's fused kernels where it does not compile, or the reference where this torch
        has neither. A step on the CPU keeps its plan's kernels, on a machine with a GPU too."""
        if param.device.type == "cpu" and self.ctx.device.type == "cuda":
            return kernel_set(host_kernels())
        return self.ctx.kernels

    def _flag_for(
        self, kernels: KernelSet, found_inf: torch.Tensor | None, param: torch.Tensor
    ) -> torch.Tensor | None:
        """The ``found_inf`` flag where ``kernels`` read it: the torch reference with ``.item()``,
        on the host; the others on the device they update on. A flag elsewhere (on a GPU, for
        the reference or for a host update of offloaded states) is copied once per step, and
        every update of the step reads that copy: read per update, it was a host sync per
        parameter on one rank."""
        if found_inf is None:
            return None
        wanted = torch.device("cpu") if kernels is reference else param.device
        if found_inf.device == wanted:
            return found_inf
        last = self._host_flag
        if last is None or last[0]() is not found_inf or last[1] != found_inf._version:
            last = (weakref.ref(found_inf), found_inf._version, found_inf.to(wanted))
            self._host_flag = last
        return last[2]

    @contextlib.contextmanager
    def _untouched(
        self,
        tensors: list[torch.Tensor | None],
        param_copy: torch.Tensor | None,
        skip: list[int],
        shard_group: str | None,
    ) -> Iterator[None]:
        """Keep the ``skip`` ranges (flat offset, numel pairs, over the unit's whole flat
        buffer) of these tensors (the weights first) as they were: parameters the loss does
        not reach are not updated, as torch.optim skips a parameter whose ``grad`` is None.
        ``param_copy`` gets those ranges of the weights as kept: it may be a host buffer other
        units' copies went through, whose old values are none of this unit's."""
        tensors = [t for t in tensors if t is not None]
        kept = [
            (lo, hi, [t[lo:hi].clone() for t in tensors])
            for lo, hi in self._in_this_tensor(skip, tensors[0].numel(), shard_group)
        ]
        yield
        for lo, hi, copies in kept:
            for t, c in zip(tensors, copies, strict=True):
                t[lo:hi].copy_(c)
            if param_copy is not None:
                param_copy[lo:hi].copy_(tensors[0][lo:hi])

    def _in_this_tensor(
        self, ranges: list[int], size: int, shard_group: str | None
    ) -> list[tuple[int, int]]:
        """``ranges`` ((offset, numel) pairs over a unit's whole flat buffer) as (start, end)
        in a tensor of ``size`` elements: the whole flat, or this rank's shard of it over
        ``shard_group``; the parts outside the shard are left out."""
        base = self.ctx.comm.on(shard_group).rank * size if shard_group else 0
        within = []
        for offset, numel in zip(ranges[::2], ranges[1::2], strict=True):
            start, end = max(offset, base) - base, min(offset + numel, base + size) - base
            if start < end:
                within.append((start, end))
        return within


def _per_rank(counts: torch.Tensor, ranks: int) -> list[int]:
    """Rows per rank of a count per expert, the experts laid out rank by rank."""
    return counts.view(ranks, -1).sum(1).tolist()
