"""The cost model: how long each node of a scheduled program takes on a device.

**Rates** (:class:`~zerocc.cost.rates.DeviceRates`, :mod:`zerocc.cost.rates`) describe a device
and its interconnect: dense compute FLOP/s per dtype, memory bytes/s, a fixed overhead per op,
link bytes/s per rank and a latency per hop, from the plan, a calibration file or the defaults.

**Work** (:class:`NodeWork`) is what a node does, independent of any rate: its FLOPs (from the
formulas of ``torch.utils.flop_counter``, the same registry ``FlopCounterMode`` uses, applied to
the node's fake input shapes without running anything), and the bytes it reads and writes (from
the fake values of its inputs and outputs; views move none). It is computed once per node and
kept in ``node.meta``.

**Time** of a compute node: ``overhead + max(flops / F[dtype], bytes / B)`` (the roofline).
A collective with ``N`` ranks and logical bytes ``S`` as :class:`~zerocc.ir.nodes.NodeInfo` counts
them (ZeRO's accounting: an all-gather its output, a reduce-scatter its input, an all-reduce twice
its size) takes, on a ring::

    all_gather, reduce_scatter:  (N - 1) * latency + (N - 1) / N * S / link
    all_reduce:                2 (N - 1) * latency + (N - 1) / N * S / link

The all-reduce is a reduce-scatter then an all-gather of its tensor (size ``S / 2``), so twice
an all-gather of that size: its ``S`` already holds the factor 2 on the bandwidth side, only
the hops are doubled. One rank costs nothing.

**Overlap**: a GPU moves a collective's bytes with its copy engines and NCCL's few SMs while
the compute stream runs; a CPU moves them through gloo with the same cores that compute. The
rate ``comm_overlap`` (1 on a GPU; on a CPU whose cores are all busy computing, about 0) is the
share of a collective's transfer (the bandwidth term) that can run alongside compute; the rest
is taken from the compute stream (:meth:`CostModel.stolen`), so on a CPU a hidden collective
hides its waiting, not its copying.

**Offload**: a copy between device and host takes ``overhead + bytes / host_link`` (PCIe on a
GPU; on a CPU-only machine an inline memcpy, taken whole from the compute stream), an NVMe read
or write ``overhead + bytes / nvme`` (on the store's I/O threads); both run on copy streams.
An op on host tensors of a GPU plan (the update of an offloaded unit, a copy between two host
tensors) runs at the host's memory rate, ``host_memory``, on the thread that issues the
device's work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from zerocc.compiler.parallel.experts import experts_flops
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.state import HOST
from zerocc.cost.memory import tensors_in
from zerocc.cost.rates import DeviceRates
from zerocc.ir.kinds import OpKind
from zerocc.ir.nodes import BATCH, info, op_kind, op_name, val
from zerocc.ir.ops import (
    DP_GROUP,
    EP_GROUP,
    EXPERT_DP_GROUP,
    GRAD_REDUCE_SCATTERS,
    HOST_TO_HOST,
    PARAM_GATHERS,
    PP_GROUP,
    QUANTIZED_STARTS,
    REPLICATE_GROUP,
    SECONDARY_GROUP,
    TP_GROUP,
)
from zerocc.ir.wire import wire_format

DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",  # (precision.matmul: fp8's _scaled_mm, by its first operand)
    torch.float8_e5m2: "fp8",
}


# --- work of a node -----------------------------------------------------------------------------

# The kinds of work a node's NodeWork has (``free``: nothing runs, see OpKind.PLUMBING).
COMPUTE, COLLECTIVE, TRANSFER, WAIT = (
    OpKind.COMPUTE,
    OpKind.COLLECTIVE,
    OpKind.TRANSFER,
    OpKind.WAIT,
)
FREE = OpKind.PLUMBING


@dataclass(frozen=True)
class NodeWork:
    """What one node does, independent of rates."""

    kind: OpKind  # compute | collective | transfer | wait | plumbing (placeholders, getitem)
    flops: float = 0.0
    bytes: int = 0  # compute: read + written; collective: logical bytes per rank; transfer: moved
    dtype: str | None = None  # dtype of the FLOPs (fp32, bf16, ...)
    ranks: int = 0  # collective: ranks taking part, when the op says (0: its group's size)
    group: str = DP_GROUP  # collective: the group of the mesh it runs on
    collective: str = ""  # collective: all_gather | ...; transfer: to_host | nvme_read | ...
    host: bool = field(default=False, compare=False)  # compute on host tensors only
    # collective: bytes its quantize and dequantize passes read and write (quantized ones)
    coded: int = 0


_WORK_KEY = "zerocc_work"
_FREE = NodeWork(FREE)


def node_work(node: fx.Node) -> NodeWork:
    """The node's :class:`NodeWork`, computed on first use and kept in ``node.meta``."""
    work = node.meta.get(_WORK_KEY)
    if work is None:
        work = node.meta[_WORK_KEY] = _work_of(node)
    return work


def _device_of(graph: fx.Graph) -> str:
    """The device a program computes on: its batch's (cpu where it has none)."""
    device = getattr(graph, "_zerocc_device", None)
    if device is None:
        batch = [val(n) for n in graph.nodes if n.op == "placeholder" and info(n).role == BATCH]
        tensors = [t for t in batch if isinstance(t, torch.Tensor)]
        device = graph._zerocc_device = tensors[0].device.type if tensors else "cpu"
    return device


def _work_of(node: fx.Node) -> NodeWork:
    kind = op_kind(node)
    if kind is OpKind.PLUMBING:
        return _FREE
    if kind is OpKind.COLLECTIVE:
        ranks = _ranks(node, op_name(node.target))
        return NodeWork(
            COLLECTIVE,
            bytes=info(node).bytes,
            ranks=ranks,
            collective=collective_kind(node),
            group=node.args[-1],
            coded=_coded_bytes(node),
        )
    if kind is OpKind.TRANSFER and node.args[-1] == HOST_TO_HOST:  # a pass over host memory
        dst, src = val(node.args[0]), val(node.args[1])
        moved = dst.numel() * (dst.element_size() + src.element_size())
        return NodeWork(COMPUTE, bytes=moved, host=True)
    if kind is OpKind.TRANSFER:
        return NodeWork(TRANSFER, bytes=info(node).bytes, collective=node.args[-1])
    if kind is OpKind.WAIT:
        return NodeWork(WAIT)
    if kind in (OpKind.VIEW, OpKind.FREE, OpKind.RNG):
        return NodeWork(COMPUTE)  # a view, a release, a generator's state: the overhead only
    args, kwargs = _values(node.args), _values(node.kwargs)
    flops, dtype = _flops(node, args, kwargs)
    inputs = tensors_in([*args, *kwargs.values()])
    # Host work: what the offload pass placed on the host, and, in a program on a GPU, any op
    # whose inputs are all in host memory. (A program traced on the CPU for an estimate has
    # every tensor there: its device is the one the rates are for.)
    on_cpu = bool(inputs) and all(t.device.type == "cpu" for t in inputs)
    host = info(node).pool == HOST or (on_cpu and _device_of(node.graph) != "cpu")
    moved = _bytes_moved(node, args, kwargs)
    if (experts := experts_flops(node)) is not None:  # no FLOPs of its own to _flops
        flops, dtype = experts[0], DTYPE_NAMES.get(experts[1])
    return NodeWork(COMPUTE, flops=flops, bytes=moved, dtype=dtype, host=host)


def _values(x: Any) -> Any:
    return fx.node.map_arg(x, val)


def _ranks(node: fx.Node, name: str) -> int:
    if name in (*PARAM_GATHERS, *GRAD_REDUCE_SCATTERS):
        return int(node.args[1])
    if name == "zerocc.all_gather_into_start":
        out, shard = val(node.args[0]), val(node.args[1])
        return out.numel() // max(shard.numel(), 1)
    return 0


def _attention_flops(args: tuple, kwargs: dict, backward: bool) -> int:
    """CPU flash attention, which torch's registry lacks; counted as the registry counts the
    other attention kernels (causal masking ignored, as ``FlopCounterMode`` does)."""
    if backward:
        grad_out, q, k, v = args[:4]
        return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
    q, k, v = args[:3]
    return sdpa_flop_count(q.shape, k.shape, v.shape)


_EXTRA_FLOPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu": lambda a, k: _attention_flops(a, k, False),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": (
        lambda a, k: _attention_flops(a, k, True)
    ),
}


def _flops(node: fx.Node, args: tuple, kwargs: dict) -> tuple[float, str | None]:
    """FLOPs of a node and the dtype they run in; memoized by target and argument shapes
    (a model's layers repeat the same ops on the same shapes)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    extra = _EXTRA_FLOPS.get(op_name(target))
    if formula is None and extra is None:
        return 0.0, None
    key = (target, _shapes((args, kwargs)))
    if key not in _FLOPS_MEMO:
        if len(_FLOPS_MEMO) >= _FLOPS_MEMO_SIZE:
            _FLOPS_MEMO.clear()
        _FLOPS_MEMO[key] = _count_flops(node, formula, extra, args, kwargs)
    return _FLOPS_MEMO[key]


_FLOPS_MEMO: dict[tuple, tuple[float, str | None]] = {}  # a pure function's results
_FLOPS_MEMO_SIZE = 2**14


def _shapes(value: Any) -> Any:
    """A hashable stand-in for arguments: tensors by shape, stride and dtype."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_shapes(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _shapes(v)) for k, v in value.items())
    return repr(value)


def _count_flops(
    node: fx.Node, formula: Any, extra: Any, args: tuple, kwargs: dict
) -> tuple[float, str | None]:
    try:
        flops = extra(args, kwargs) if extra else formula(*args, out_val=val(node), **kwargs)
    except Exception:  # a formula that does not fit these arguments: count it memory-bound
        return 0.0, None
    first = next((t for t in tensors_in(list(args)) if t.is_floating_point()), None)
    return float(flops), DTYPE_NAMES.get(first.dtype) if first is not None else None


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, at most its storage (expanded views)."""
    logical = t.numel() * t.element_size()
    try:
        return min(logical, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return logical


def _bytes_moved(node: fx.Node, args: tuple, kwargs: dict) -> int:
    """Bytes read (every tensor argument) and written (results, and arguments written in
    place, which are read too)."""
    read = sum(_nbytes(t) for t in tensors_in(list(args) + list(kwargs.values())))
    written = sum(_nbytes(t) for t in tensors_in(val(node)))
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            written += sum(_nbytes(t) for t in tensors_in(value))
        if any(r.alias_info is not None for r in schema.returns):
            written -= sum(_nbytes(t) for t in tensors_in(val(node)))  # in place: counted above
    return read + max(written, 0)


# --- time of a node -----------------------------------------------------------------------------


class CostModel:
    """Seconds each node of a program takes under ``rates`` with ``world_size`` ranks (laid
    out as ``mesh`` says, see :mod:`zerocc.compiler.parallel.mesh`): a compute node on
    the compute stream, a collective (its start node) on the comm stream; waits cost nothing of
    their own (the simulator makes them block). Cached per node."""

    def __init__(self, rates: DeviceRates, world_size: int, mesh: Mesh | None = None) -> None:
        self.rates, self.world_size = rates, world_size
        mesh = mesh or Mesh(world_size)
        self.group_ranks = {
            DP_GROUP: mesh.shard_size,
            REPLICATE_GROUP: mesh.replicate,
            TP_GROUP: mesh.tp,
            EP_GROUP: mesh.ep,
            EXPERT_DP_GROUP: mesh.expert_shard_size,
            SECONDARY_GROUP: mesh.secondary,
        }
        self._cache: dict[fx.Node, float] = {}

    def ranks(self, work: NodeWork) -> int:
        """Ranks taking part in a collective: what the op says, else its group's size."""
        return work.ranks or self.group_ranks.get(work.group, self.world_size)

    @property
    def issue_s(self) -> float:
        """Compute-stream time to issue one collective (one op's overhead)."""
        return self.rates.overhead_s

    def __call__(self, node: fx.Node) -> float:
        seconds = self._cache.get(node)
        if seconds is None:
            seconds = self._cache[node] = self.work_time(node_work(node))
        return seconds

    def work_time(self, work: NodeWork) -> float:
        if work.kind == COMPUTE and work.host and self.rates.device != "cpu":
            return self.rates.overhead_s + work.bytes / self.rates.host_memory_bytes_per_s
        if work.kind == COMPUTE:
            return self.compute_time(work.flops, work.bytes, work.dtype)
        if work.kind == COLLECTIVE:
            return self.collective_time(work.collective, work.bytes, self.ranks(work), work.group)
        if work.kind == TRANSFER:
            return self.transfer_time(work.collective, work.bytes)
        return 0.0

    def transfer_time(self, direction: str, nbytes: float) -> float:
        """A copy between device and host (``to_host``, ``to_device``) or an NVMe read or
        write of ``nbytes``."""
        r = self.rates
        rate = r.nvme_bytes_per_s if direction.startswith("nvme") else r.host_link_bytes_per_s
        return r.overhead_s + nbytes / rate

    def compute_time(self, flops: float, nbytes: float, dtype: str | None = None) -> float:
        """Roofline: the op's overhead plus the longer of its math and its memory traffic."""
        r = self.rates
        return r.overhead_s + max(flops / r.flops_per_s(dtype), nbytes / r.memory_bytes_per_s)

    def collective_time(
        self, kind: str, nbytes: float, ranks: int | None = None, group: str = DP_GROUP
    ) -> float:
        """Ring alpha-beta time of a collective of ``nbytes`` logical bytes on ``group``
        (module docs)."""
        ranks = ranks or self.world_size
        if ranks <= 1:
            return 0.0
        latency, link = self.rates.link(kind, group)
        return ring_hops(kind, ranks) * latency + (ranks - 1) / ranks * nbytes / link

    def send_time(self, nbytes: float) -> float:
        """A send of ``nbytes`` from one pipeline rank to another: one hop's latency plus the
        bytes over the ``pp`` group's link (``cost.group_link_gbps.pp``, else the link's)."""
        if not nbytes:
            return 0.0
        latency, link = self.rates.link("send", PP_GROUP)
        return latency + nbytes / link

    def stolen(self, node: fx.Node) -> float:
        """Compute-stream seconds a collective takes while it runs: the share of its transfer
        that cannot overlap compute (``1 - comm_overlap`` of the bandwidth term), and a
        quantized one's quantize and dequantize passes (memory-bound, on the compute stream)."""
        work = node_work(node)
        if work.kind == TRANSFER:  # on a CPU-only machine a copy is an inline memcpy
            inline = self.rates.device == "cpu" and not work.collective.startswith("nvme")
            return self(node) if inline else 0.0
        if work.kind != COLLECTIVE:
            return 0.0
        coding = self.compute_time(0.0, work.coded) + self.rates.overhead_s if work.coded else 0.0
        ranks = self.ranks(work)
        if ranks <= 1 or self.rates.comm_overlap >= 1:
            return coding
        _, link = self.rates.link(work.collective, work.group)
        transfer = (ranks - 1) / ranks * work.bytes / link
        return (1 - self.rates.comm_overlap) * transfer + coding


def _coded_bytes(node: fx.Node) -> int:
    """Bytes a quantized collective's quantize and dequantize passes read and write (0 for
    another): the whole flat once in its dtype (the gather's result, the reduction's input), in
    fp32 twice (the scaled values written, then read), and in the wire format once."""
    if op_name(node.target) not in QUANTIZED_STARTS:
        return 0
    full = val(node) if op_name(node.target) in PARAM_GATHERS else val(node.args[0])
    wire = wire_format(node.args[3])
    return full.numel() * (full.element_size() + 8) + wire.payload_bytes(full.numel())


def ring_hops(kind: str, ranks: int) -> int:
    """Steps of a ring collective: N - 1, twice for an all-reduce (reduce-scatter + gather)."""
    return (ranks - 1) * (2 if kind == "all_reduce" else 1)


def collective_kind(node: fx.Node) -> str:
    """all_gather | reduce_scatter | all_reduce | all_to_all, from a start node's op (expert
    parallelism's exchanges of rows are all-to-alls)."""
    name = op_name(node.target).removeprefix("zerocc.")
    if name.startswith("all_to_all"):
        return "all_to_all"
    return name.removesuffix("_start").removesuffix("_into").removesuffix("_quantized")
