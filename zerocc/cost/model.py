"""The cost model: how long each node of a scheduled program takes on a device.

**Rates** (:class:`DeviceRates`) describe a device and its interconnect: dense compute FLOP/s
per dtype, memory bytes/s, a fixed overhead per op (on CPU the eager interpreter's dispatch
dominates small ops; on GPU the launch), link bytes/s per rank and a latency per hop. They come,
field by field, from the plan's ``cost`` section, else from a calibration file that
``zerocc profile`` wrote, else from :data:`DEFAULT_RATES` for the device.

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

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from zerocc.compiler.parallel.experts import Exchanges, exchanges_of, experts_flops
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.state import HOST
from zerocc.cost.memory import tensors_in
from zerocc.errors import PlanError
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

if TYPE_CHECKING:
    from zerocc.compiler.plan import Plan

CALIBRATION_FORMAT = "zerocc-calibration/1"
DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",  # (precision.matmul: fp8's _scaled_mm, by its first operand)
    torch.float8_e5m2: "fp8",
}

# Built-in rates, used where neither the plan nor a calibration file gives one. Achievable
# rates, not datasheet peaks: what eager ops reach on such a device.
DEFAULT_RATES: dict[str, dict[str, Any]] = {
    # One core of a recent x86 server (the CPU backend runs each rank on its share of the
    # cores): ~80 GFLOP/s in fp32 and bf16 matmuls, ~8 GB/s through eager elementwise ops,
    # ~10 us of dispatch per op through the interpreter; gloo over loopback. float8 matmuls
    # run torch's reference _scaled_mm, element by element: 0.06 GFLOP/s measured (128²).
    "cpu": {
        "compute_flops": {"fp32": 80e9, "bf16": 80e9, "fp16": 20e9, "fp8": 0.05e9},
        "memory_bytes_per_s": 8e9,
        "overhead_s": 10e-6,
        "link_bytes_per_s": 2e9,
        "latency_s": 50e-6,
        "comm_overlap": 0.0,
        "host_link_bytes_per_s": 8e9,
        "nvme_bytes_per_s": 2e9,
        "host_memory_bytes_per_s": 8e9,
    },
    # One H100/H200-class GPU: ~70% of the 989 TFLOP/s bf16/fp16 dense peak (and of fp8's
    # 1979), plain fp32 (no TF32) ~50 TFLOP/s, ~3 TB/s of HBM, ~5 us per eagerly launched op;
    # one 400 Gbit/s NDR InfiniBand link per GPU (a ring across nodes runs at that), ~5 us per
    # hop.
    "cuda": {
        "compute_flops": {"fp32": 50e12, "bf16": 700e12, "fp16": 700e12, "fp8": 1400e12},
        "memory_bytes_per_s": 3.0e12,
        "overhead_s": 5e-6,
        "link_bytes_per_s": 400e9 / 8,
        "latency_s": 5e-6,
        "comm_overlap": 1.0,
        # PCIe Gen5 x16 from pinned memory, a datacenter NVMe drive, and the one-pass host
        # update on a GPU's share of the host's cores, as measured on one H100 machine's 16
        # (2026-11-26): copies at 53-55 GB/s each way, the update at 124-137 GB/s.
        "host_link_bytes_per_s": 50e9,
        "nvme_bytes_per_s": 3e9,
        "host_memory_bytes_per_s": 120e9,
    },
}
RATE_FIELDS = ("compute_flops", "memory_bytes_per_s", "overhead_s", "link_bytes_per_s",
               "latency_s", "comm_overlap", "host_link_bytes_per_s", "nvme_bytes_per_s",
               "host_memory_bytes_per_s")  # fmt: skip
OFFLOAD_RATES = RATE_FIELDS[6:]  # absent from calibration files older than offload


@dataclass
class DeviceRates:
    """Rates of one device and its interconnect (SI units: FLOP/s, bytes/s, seconds)."""

    device: str  # cpu | cuda: whose defaults filled what nothing else gave
    compute_flops: dict[str, float]  # dense FLOP/s by compute dtype (fp32, bf16, fp16)
    memory_bytes_per_s: float  # bandwidth of memory-bound (elementwise, copy) ops
    overhead_s: float  # fixed cost of every op launched (dispatch, launch)
    link_bytes_per_s: float  # per-rank interconnect bandwidth
    latency_s: float  # per-hop latency of a collective (the alpha term)
    comm_overlap: float  # share of a collective's transfer that runs alongside compute (0-1)
    host_link_bytes_per_s: float = 8e9  # copies between device and host memory (PCIe)
    nvme_bytes_per_s: float = 2e9  # reads and writes of offloaded state files
    host_memory_bytes_per_s: float = 8e9  # ops on host tensors while the device is a GPU
    # Fitted per collective kind where a backend runs them unlike one ring (gloo's all-gather
    # moves a byte about half as fast as its all-reduce): kind -> latency_s, link_bytes_per_s.
    # Setting the link or latency (plan, flags) drops them.
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    # Link bytes/s of the collectives of one mesh group (``tp`` within a node's NVLink,
    # ``replicate`` across nodes), over the rest's; from the plan's cost.group_link_gbps.
    group_links: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # rate -> default | calibration | plan

    @classmethod
    def defaults(cls, device: str) -> DeviceRates:
        """The built-in rates of ``device`` (cpu or cuda)."""
        if device not in DEFAULT_RATES:
            raise PlanError(f"no default rates for device {device!r}; known: cpu, cuda")
        rates = dict(DEFAULT_RATES[device])
        rates["compute_flops"] = dict(rates["compute_flops"])
        return cls(device, **rates, sources=dict.fromkeys(RATE_FIELDS, "default"))

    def uncalibrated(self) -> str | None:
        """A warning when the rates that set compute time (compute, memory, per-op overhead)
        are built-in defaults rather than measured here or given by the plan, else None.
        Defaults describe a typical device, not this one: on a CPU they are ~10x off a
        measured step."""
        defaults = [
            name
            for field, name in (
                ("compute_flops", "compute"),
                ("memory_bytes_per_s", "memory"),
                ("overhead_s", "per-op overhead"),
            )
            if self.sources.get(field, "default") == "default"
        ]
        if not defaults:
            return None
        typical = {
            "cpu": "a typical CPU's, ~10x off a step measured on one",
            "cuda": "an H100's datasheet figures, which a real step reaches only in part",
        }.get(self.device, "typical figures")
        return (
            f"predicted times use the built-in {self.device} rates for {', '.join(defaults)} "
            f"({typical}), not rates measured on the machine that trains. Calibrate there: "
            "`zerocc profile PLAN` measures them and writes PLAN.calibration.json; name it in "
            "the plan's cost.calibration (or pass --calibration), or set cost.compute_tflops / "
            "memory_gb_per_s"
        )

    def flops_per_s(self, dtype: str | None) -> float:
        """Compute rate of ``dtype`` (fp32, bf16, ...); the slowest known for any other."""
        rate = self.compute_flops.get(dtype or "fp32")
        return rate if rate is not None else min(self.compute_flops.values())

    def replace(self, source: str, **rates: Any) -> DeviceRates:
        """A copy with the given rates set (those not None), marked as coming from ``source``."""
        given = {k: v for k, v in rates.items() if v is not None}
        if "compute_flops" in given:
            given["compute_flops"] = {**self.compute_flops, **given["compute_flops"]}
        if "collectives" not in given and given.keys() & {"link_bytes_per_s", "latency_s"}:
            given["collectives"] = {}
        sources = {**self.sources, **dict.fromkeys(given, source)}
        return dataclasses.replace(self, **given, sources=sources)

    def link(self, kind: str, group: str = DP_GROUP) -> tuple[float, float]:
        """(latency per hop, link bytes/s) of a collective kind on a mesh group."""
        fitted = self.collectives.get(kind)
        latency, link = (
            (fitted["latency_s"], fitted["link_bytes_per_s"])
            if fitted
            else (self.latency_s, self.link_bytes_per_s)
        )
        return latency, self.group_links.get(group, link)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "compute_flops": dict(self.compute_flops),
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "overhead_s": self.overhead_s,
            "link_bytes_per_s": self.link_bytes_per_s,
            "latency_s": self.latency_s,
            "comm_overlap": self.comm_overlap,
            "host_link_bytes_per_s": self.host_link_bytes_per_s,
            "nvme_bytes_per_s": self.nvme_bytes_per_s,
            "host_memory_bytes_per_s": self.host_memory_bytes_per_s,
            "collectives": {k: dict(v) for k, v in self.collectives.items()},
        }

    def describe(self) -> str:
        """One line in the units people quote: TFLOP/s, GB/s, us, Gbit/s."""
        flops = ", ".join(f"{d} {r / 1e12:.3g}" for d, r in sorted(self.compute_flops.items()))
        line = (
            f"{self.device}: compute TFLOP/s {flops}; memory {self.memory_bytes_per_s / 1e9:.3g}"
            f" GB/s; {self.overhead_s * 1e6:.3g} us per op; link "
            f"{self.link_bytes_per_s * 8 / 1e9:.3g} Gbit/s, {self.latency_s * 1e6:.3g} us per hop,"
            f" {100 * self.comm_overlap:.0f}% overlappable with compute; host link "
            f"{self.host_link_bytes_per_s / 1e9:.3g} GB/s, NVMe {self.nvme_bytes_per_s / 1e9:.3g}"
            f" GB/s, host memory {self.host_memory_bytes_per_s / 1e9:.3g} GB/s"
        )
        for kind, fitted in sorted(self.collectives.items()):
            line += (f"; {kind} {fitted['link_bytes_per_s'] * 8 / 1e9:.3g} Gbit/s, "
                     f"{fitted['latency_s'] * 1e6:.3g} us")  # fmt: skip
        for group, link in sorted(self.group_links.items()):
            line += f"; {group} group link {link * 8 / 1e9:.3g} Gbit/s"
        return line

    def save(self, path: str | os.PathLike[str], measured: dict[str, Any] | None = None) -> None:
        """Write the rates (and what was measured to fit them) as a calibration file."""
        data = {"format": CALIBRATION_FORMAT, "rates": self.as_dict(), "measured": measured or {}}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceRates:
        """Read a calibration file written by :meth:`save` (``zerocc profile``)."""
        try:
            data = json.loads(Path(path).read_text())
            rates = data["rates"]
            if data.get("format") != CALIBRATION_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {CALIBRATION_FORMAT}")
            defaults = DEFAULT_RATES.get(rates["device"], DEFAULT_RATES["cpu"])
            offload = {k: rates.get(k, defaults[k]) for k in OFFLOAD_RATES}
            loaded = cls(**{k: rates[k] for k in ("device", *RATE_FIELDS[:6])}, **offload,
                         collectives=rates.get("collectives", {}))  # fmt: skip
        except FileNotFoundError:
            raise PlanError(f"calibration file {path}: not found") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"calibration file {path}: not a zerocc calibration: {exc}") from None
        loaded.sources = dict.fromkeys(RATE_FIELDS, "calibration")
        return loaded


def rates_for(
    plan: Plan, device: str | None = None, calibration: str | os.PathLike[str] | None = None
) -> DeviceRates:
    """The rates an estimate of ``plan`` uses: ``plan.cost`` fields over the calibration file
    (``calibration``, else the plan's ``cost.calibration``, relative to the plan file) over the
    defaults of ``device`` (default: the plan's backend device; ``auto`` is this machine's)."""
    cost = plan.cost
    path = Path(calibration) if calibration is not None else None
    if path is None and cost.calibration is not None:
        path = Path(cost.calibration)
        if not path.is_absolute() and plan.source:
            path = Path(plan.source).resolve().parent / path
    if path is not None and device is None:
        rates = DeviceRates.load(path)
    else:
        rates = DeviceRates.defaults(device or device_kind(plan))
        if path is not None:
            loaded = DeviceRates.load(path)
            fields = {k: getattr(loaded, k) for k in (*RATE_FIELDS, "collectives")}
            rates = rates.replace("calibration", **fields)
    flops = cost.compute_tflops
    return rates.replace(
        "plan",
        compute_flops=dict.fromkeys(rates.compute_flops, flops * 1e12) if flops else None,
        memory_bytes_per_s=cost.memory_gb_per_s * 1e9 if cost.memory_gb_per_s else None,
        link_bytes_per_s=cost.link_gbps * 1e9 / 8 if cost.link_gbps else None,
        latency_s=cost.latency_us * 1e-6 if cost.latency_us is not None else None,
        group_links={g: gbps * 1e9 / 8 for g, gbps in cost.group_link_gbps.items()} or None,
    )


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
    # compute: the experts' token exchanges it waits for inside (expert parallelism's regions)
    exchanges: Exchanges | None = None
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
    if (experts := experts_flops(node)) is not None:  # a region: no FLOPs of its own to _flops
        flops, dtype = experts[0], DTYPE_NAMES.get(experts[1])
    return NodeWork(COMPUTE, flops=flops, bytes=moved, dtype=dtype, host=host,
                    exchanges=exchanges_of(node))  # fmt: skip


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
            return self.compute_time(work.flops, work.bytes, work.dtype) + self._exchanged(work)
        if work.kind == COLLECTIVE:
            return self.collective_time(work.collective, work.bytes, self.ranks(work), work.group)
        if work.kind == TRANSFER:
            return self.transfer_time(work.collective, work.bytes)
        return 0.0

    def _exchanged(self, work: NodeWork) -> float:
        """The experts' all-to-alls a compute node waits for inside (0 for most)."""
        x = work.exchanges
        if x is None:
            return 0.0
        return x.count * self.collective_time("all_to_all", x.nbytes, x.parts, EP_GROUP)

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
    """all_gather | reduce_scatter | all_reduce, from a start node's op."""
    name = op_name(node.target).removeprefix("zerocc.")
    return name.removesuffix("_start").removesuffix("_into").removesuffix("_quantized")


def device_kind(plan: Plan) -> str:
    """``cpu`` or ``cuda``: ``backend.device`` with ``auto`` resolved on this machine. What a
    rank-independent use (an estimate's default rates) needs; a rank's own device is
    :func:`rank_device`."""
    if plan.backend.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return plan.backend.device
