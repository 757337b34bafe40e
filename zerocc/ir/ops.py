"""zerocc's own ops: their schemas and fake (meta) implementations, in the ``zerocc`` namespace.

A scheduled graph stays printable, shape-propagatable on fake tensors and lowerable because
every op it holds has a schema and a fake implementation here. What an op does when a program
runs is the backend's: :mod:`zerocc.backends.eager` registers the eager implementations.

Collectives come in start/wait pairs: ``*_start`` issues the collective and returns its (not
yet valid) result; ``wait`` blocks until it is valid and returns it. The offload copies are
start/wait pairs too (``copy_start``, ``copy_into_start``, ``nvme_read_start``,
``nvme_write_start``; ``direction`` names the traffic: on a CPU-only machine host and device are
the same memory, so the op cannot tell by itself). Schemas carry alias annotations, so fx and the
verifier know that ``wait`` returns its input and that ``all_reduce_start`` writes its argument.
"""

from __future__ import annotations

import torch
from torch.library import Library

DP_GROUP = "dp"  # the group a unit is sharded over (every rank, unless sharding is hybrid)
REPLICATE_GROUP = "replicate"  # the ranks that hold the same shard (hybrid sharding)
TP_GROUP = "tp"  # the ranks that split a layer (tensor parallelism)
PP_GROUP = "pp"  # the ranks that hold the stages of one pipeline, in stage order
TIE_GROUP = "tie"  # the first and the last of them: a tied embedding's and head's holders
EP_GROUP = "ep"  # the ranks that split the experts (expert parallelism): tokens exchanged
EXPERT_DP_GROUP = "edp"  # the ranks holding the same experts: their states sharded over them
# Consecutive ranks of a shard group (a node's) that hold a second copy of stage 3's
# parameters for backward's all-gathers (zero.secondary_group, ZeRO++'s hpZ)
SECONDARY_GROUP = "secondary"
# The groups units are gathered (and, but for the secondary one, reduced) over
UNIT_GROUPS = (DP_GROUP, EXPERT_DP_GROUP, SECONDARY_GROUP)
# The all-gathers of a unit's parameters: as they are, or quantized on the wire
PARAM_GATHERS = ("zerocc.all_gather_start", "zerocc.all_gather_quantized_start")
GRAD_REDUCE_SCATTERS = ("zerocc.reduce_scatter_start", "zerocc.reduce_scatter_quantized_start")
ALL_REDUCE = "zerocc.all_reduce_start"
QUANTIZED_STARTS = ("zerocc.all_gather_quantized_start", "zerocc.reduce_scatter_quantized_start")


def reported_kind(kind: str, group: str) -> str:
    """How a collective of ``kind`` (``all_gather``, ...) on ``group`` is counted and reported:
    by its kind on the ``dp`` group, else with its group (``all_reduce (replicate)``)."""
    return kind if group == DP_GROUP else f"{kind} ({group})"


CPU = torch.device("cpu")
_lib = Library("zerocc", "DEF")

SCHEMAS = {
    "all_gather_start": "all_gather_start(Tensor shard, int world_size, str group) -> Tensor",
    # (the shard quantized in blocks, in the wire format ``wire`` (zerocc.ir.wire), gathered
    # with the blocks' scales, dequantized)
    "all_gather_quantized_start": (
        "all_gather_quantized_start(Tensor shard, int world_size, int block, str wire, "
        "str group) -> Tensor"
    ),
    "all_gather_into_start": (
        "all_gather_into_start(Tensor(a!) out, Tensor shard, str group) -> Tensor(a!)"
    ),
    "reduce_scatter_start": (
        "reduce_scatter_start(Tensor full, int world_size, str group) -> Tensor"
    ),
    # (each destination's chunk quantized in blocks, in the wire format ``wire``, exchanged,
    # summed in fp32)
    "reduce_scatter_quantized_start": (
        "reduce_scatter_quantized_start(Tensor full, int world_size, int block, str wire, "
        "str group) -> Tensor"
    ),
    "all_reduce_start": "all_reduce_start(Tensor(a!) tensor, str group) -> Tensor(a!)",
    "wait": "wait(Tensor(a) tensor) -> Tensor(a)",
    "free": "free(Tensor(a!) tensor) -> ()",
    "pack": "pack(Tensor?[] tensors, int[] numels, SymInt numel, ScalarType? dtype=None) -> Tensor",
    "unscale_check_": "unscale_check_(Tensor(a!)[] grads, Tensor inv_scale) -> Tensor",
    "sum_squares": "sum_squares(Tensor[] tensors, float scale) -> Tensor",
    "nonfinite_flags": "nonfinite_flags(Tensor[] grads, float scale, bool sum_squares) -> Tensor",
    "clip_coef": "clip_coef(Tensor total_sq, float max_norm) -> Tensor",
    # Tensor parallelism: this rank's index in ``group`` (a 0-dim int64 tensor on ``like``'s
    # device), for the slice of a split layer it holds; and a gradient's squared norm in which
    # the elements of the ``shared`` (offset, numel) ranges, which every one of the ``parts``
    # tensor-parallel ranks holds alike, count 1/parts (``shard_group``: ranges over the unit's
    # whole flat, ``grad`` this rank's shard of it over that group), so that the sum over the
    # ranks counts each element once.
    "group_rank": "group_rank(Tensor like, str group) -> Tensor",
    "sum_squares_tp": (
        "sum_squares_tp(Tensor grad, float scale, int[] shared, int parts, str? shard_group)"
        " -> Tensor"
    ),
    # Offload: a host buffer of ``numel`` elements, the same one every step for ``key`` (the
    # runtime's HostBuffers; pinned where a GPU copies it): the staging the host update writes
    # the compute copy into, for a copy of that dtype to the device.
    "host_buffer": "host_buffer(SymInt numel, ScalarType dtype, str key) -> Tensor",
    # Offload, updates deferred (``offload.defer_updates``): an update on the host stream
    # runs on the host's worker thread, beside what the program issues next; ``host_wait`` returns
    # ``tensor`` (what the update wrote that is read next) once the update named ``update``
    # (its node) is done.
    "host_wait": "host_wait(Tensor(a) tensor, str update) -> Tensor(a)",
    # Pipeline stages (zerocc.compiler.parallel.stage_cut): what crosses a cut, and what a
    # stage's forward keeps for its backward, by name, for the micro-batch the runtime runs:
    # ``send`` to the rank holding ``stage``, ``recv`` from it; ``keep`` a tensor, ``kept`` it.
    "send": "send(Tensor tensor, int stage, str name) -> ()",
    "recv": "recv(SymInt[] shape, ScalarType dtype, Device device, int stage, str name) -> Tensor",
    "keep": "keep(Tensor tensor, str name) -> ()",
    "kept": "kept(SymInt[] shape, ScalarType dtype, Device device, str name) -> Tensor",
    # Expert parallelism (zerocc.compiler.parallel.experts). ``all_to_all_start``: equal
    # chunks of ``tensor`` exchanged (each rank's count of rows per expert). The rows of an
    # experts call go to the ranks holding their experts (``all_to_all_experts_start``: rows
    # ``sent[e]`` to expert ``e``, ``got`` those received), and come back
    # (``all_to_all_tokens_start``). How many rows a rank receives depends on the routing, so
    # the received rows are no value of the program: the runtime keeps them under a key
    # (``into``; ``take`` reads and drops them) and the op returns a one-element ticket that
    # orders what reads them. ``experts_forward`` runs the experts module of ``call`` on the rows
    # its exchange received (its ticket; kept for the backward when ``keep``, else dropped),
    # keeping its results; ``experts_backward`` their
    # gradient: a ticket for the received rows' gradients (kept when ``rows_grad``), then each
    # state tensor's.
    "all_to_all_start": "all_to_all_start(Tensor tensor, str group) -> Tensor",
    "all_to_all_experts_start": (
        "all_to_all_experts_start(Tensor rows, Tensor sent, Tensor got, str into, str group)"
        " -> Tensor"
    ),
    "all_to_all_tokens_start": (
        "all_to_all_tokens_start(Tensor ticket, Tensor sent, Tensor got, SymInt[] shape, "
        "ScalarType dtype, str take, str group) -> Tensor"
    ),
    "experts_forward": (
        "experts_forward(Tensor ticket, Tensor got, Tensor[] state, bool keep, str call)"
        " -> Tensor"
    ),
    "experts_backward": (
        "experts_backward(Tensor ticket, Tensor got, Tensor[] state, bool rows_grad, str call)"
        " -> Tensor[]"
    ),
    "adamw_": (
        "adamw_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq,"
        " Tensor step, Tensor? grad_coef, Tensor? found_inf, Tensor(d!)? param_copy,"
        " float grad_scale, Tensor lr, float beta1, float beta2, float eps, float weight_decay,"
        " int[] skip, str? shard_group) -> ()"
    ),
    "sgd_": (
        "sgd_(Tensor(a!) param, Tensor grad, Tensor(b!)? momentum_buffer, Tensor? grad_coef,"
        " Tensor? found_inf, Tensor(d!)? param_copy, float grad_scale, Tensor lr,"
        " float momentum, float weight_decay, int[] skip, str? shard_group) -> ()"
    ),
    # Any other elementwise optimizer of the plan's registry (zerocc.compiler.plan.optimizers),
    # named by ``optimizer``, its fields' values in ``hyper`` (the registry's order, booleans
    # 0/1), its states (as many as it keeps, the rest None) in the registry's order: torch's
    # functional form run on the flat shard (zerocc.backends.kernels.torch_optim).
    "optim_update_": (
        "optim_update_(Tensor(a!) param, Tensor grad, Tensor(b!)? state0, Tensor(c!)? state1,"
        " Tensor(e!)? state2, Tensor? step, Tensor? grad_coef, Tensor? found_inf,"
        " Tensor(d!)? param_copy, float grad_scale, Tensor lr, str optimizer, float[] hyper,"
        " int[] skip, str? shard_group) -> ()"
    ),
}
# The most states an update op of the registry's optimizers takes (optim_update_'s state0-2).
MAX_UPDATE_STATES = 3
# The ops that update a unit's weights (one per unit, or per parameter's slice, per step).
UPDATE_OPS = ("adamw_", "sgd_", "optim_update_")
COLLECTIVE_STARTS = (
    "all_gather_start",
    "all_gather_quantized_start",
    "all_gather_into_start",
    "reduce_scatter_start",
    "reduce_scatter_quantized_start",
    "all_reduce_start",
    "all_to_all_start",
    "all_to_all_experts_start",
    "all_to_all_tokens_start",
)
# An experts call's rows going to the ranks of their experts, and coming back
TO_EXPERTS, TO_TOKENS = "zerocc.all_to_all_experts_start", "zerocc.all_to_all_tokens_start"
# Expert parallelism's ops: their results and what the runtime keeps follow the call that made
# them, so they are never recomputed, copied into a repeated layer's template or dropped.
EXPERT_OPS = (
    "all_to_all_experts_start",
    "all_to_all_tokens_start",
    "experts_forward",
    "experts_backward",
)
EXPERT_OP_NAMES = frozenset(f"zerocc.{name}" for name in EXPERT_OPS)  # (as op_name says them)

TRANSFER_SCHEMAS = {
    "copy_start": "copy_start(Tensor src, Device device, str direction) -> Tensor",
    "copy_into_start": ("copy_into_start(Tensor(a!) dst, Tensor src, str direction) -> Tensor(a!)"),
    "nvme_read_start": (
        "nvme_read_start(str key, SymInt[] shape, ScalarType dtype, Device device,"
        " str direction) -> Tensor"
    ),
    "nvme_write_start": "nvme_write_start(Tensor(a) src, str key, str direction) -> Tensor(a)",
}
TRANSFER_STARTS = tuple(TRANSFER_SCHEMAS)
TO_HOST, TO_DEVICE, NVME_READ, NVME_WRITE = "to_host", "to_device", "nvme_read", "nvme_write"
# A copy between two host tensors (a master cast into a compute copy kept in host memory): no
# link, but a pass over host memory, inline on the thread that issues the device's work.
HOST_TO_HOST = "host_to_host"
# A copy of at most this many bytes (the step's clip coefficient and overflow flag, which host
# updates read) runs in the compute stream's order, not queued behind the copy stream's bulk
# transfers (every gradient's, issued in backward): the first host update would wait for all.
INLINE_COPY_BYTES = 64 * 1024

for _schema in (*SCHEMAS.values(), *TRANSFER_SCHEMAS.values()):
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


@fake("send")
def _(tensor, stage, name):
    return None


@fake("keep")
def _(tensor, name):
    return None


@fake("recv")
def _(shape, dtype, device, stage, name):
    return torch.empty(shape, dtype=dtype, device=device)


@fake("kept")
def _(shape, dtype, device, name):
    return torch.empty(shape, dtype=dtype, device=device)


for _name in ("send", "keep", "recv", "kept"):  # never dropped as dead code, never reordered
    torch.fx.node.has_side_effect(getattr(torch.ops.zerocc, _name).default)


@fake("all_to_all_start")
def _(tensor, group):
    return torch.empty_like(tensor)


@fake("all_to_all_experts_start")
def _(rows, sent, got, into, group):
    return rows.new_empty((1,))


@fake("all_to_all_tokens_start")
def _(ticket, sent, got, shape, dtype, take, group):
    return torch.empty(tuple(shape), dtype=dtype, device=ticket.device)


@fake("experts_forward")
def _(ticket, got, state, keep, call):
    return torch.empty_like(ticket)


@fake("experts_backward")
def _(ticket, got, state, rows_grad, call):
    return [torch.empty_like(ticket), *(torch.empty_like(t) for t in state)]


for _name in EXPERT_OPS:
    torch.fx.node.has_side_effect(getattr(torch.ops.zerocc, _name).default)


@fake("all_gather_start")
def _(shard, world_size, group):
    return shard.new_empty(shard.numel() * world_size)


@fake("all_gather_quantized_start")
def _(shard, world_size, block, wire, group):
    return shard.new_empty(shard.numel() * world_size)


@fake("reduce_scatter_quantized_start")
def _(full, world_size, block, wire, group):
    return full.new_empty(full.numel() // world_size)


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


@fake("host_wait")
def _(tensor, update):
    return tensor


@fake("free")
def _(tensor):
    return None


@fake("host_buffer")
def _(numel, dtype, key):
    return torch.empty(numel, dtype=dtype, device=CPU)


@fake("pack")
def _(tensors, numels, numel, dtype=None):
    like = next(t for t in tensors if t is not None)
    return like.new_empty(numel, dtype=dtype or like.dtype)


@fake("unscale_check_")
def _(grads, inv_scale):
    return inv_scale.new_empty((), dtype=torch.float32)


@fake("nonfinite_flags")
def _(grads, scale, sum_squares):
    return grads[0].new_empty(len(grads) + int(sum_squares), dtype=torch.float32)


@fake("sum_squares")
def _(tensors, scale):
    return tensors[0].new_empty((), dtype=torch.float32)


@fake("group_rank")
def _(like, group):
    return like.new_empty((), dtype=torch.int64)


@fake("sum_squares_tp")
def _(grad, scale, shared, parts, shard_group):
    return grad.new_empty((), dtype=torch.float32)


@fake("clip_coef")
def _(total_sq, max_norm):
    return total_sq.new_empty(())


@fake("adamw_")
def _(*args):
    return None


@fake("sgd_")
def _(*args):
    return None


@fake("optim_update_")
def _(*args):
    return None


@fake("copy_start")
def _(src, device, direction):
    return torch.empty(src.shape, dtype=src.dtype, device=device)


@fake("copy_into_start")
def _(dst, src, direction):
    return dst


@fake("nvme_read_start")
def _(key, shape, dtype, device, direction):
    return torch.empty(tuple(shape), dtype=dtype, device=device)


@fake("nvme_write_start")
def _(src, key, direction):
    return src


def op(name: str) -> torch._ops.OpOverload:
    """The default overload of ``zerocc.<name>``."""
    return getattr(torch.ops.zerocc, name).default
