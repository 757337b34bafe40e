"""Rates of a device and its interconnect, which the cost model (:mod:`zerocc.cost.model`)
times a program's nodes with.

:class:`DeviceRates` holds dense compute FLOP/s per dtype, memory bytes/s, a fixed overhead per
op (on CPU the eager interpreter's dispatch dominates small ops; on GPU the launch), link bytes/s
per rank and a latency per hop, the host link, NVMe and host memory rates, and where a backend
runs a collective kind unlike one ring, that kind's own fit. They come, field by field, from
the plan's ``cost`` section, else from a calibration file that ``zerocc profile`` wrote, else
from :data:`DEFAULT_RATES` for the device (:func:`rates_for`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerocc.errors import PlanError
from zerocc.ir.ops import DP_GROUP

if TYPE_CHECKING:
    from zerocc.compiler.plan import Plan

CALIBRATION_FORMAT = "zerocc-calibration/1"

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

    @property
    def on_gloo(self) -> bool:
        """Whether the device's collectives run on gloo (a CPU's), whose buffers a prediction
        counts (:func:`zerocc.cost.memory.predict_memory`)."""
        return self.device == "cpu"

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
        except OSError as exc:
            raise PlanError(f"calibration file {path}: cannot be read: {exc.strerror}") from None
        except (ValueError, KeyError, TypeError) as exc:
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
    path = Path(calibration) if calibration is not None else calibration_path(plan)
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


def calibration_path(plan: Plan) -> Path | None:
    """The plan's ``cost.calibration``, relative to the plan file (None when it names none)."""
    if plan.cost.calibration is None:
        return None
    path = Path(plan.cost.calibration)
    if not path.is_absolute() and plan.source:
        path = Path(plan.source).resolve().parent / path
    return path


def check_calibration(plan: Plan) -> None:
    """PlanError naming ``cost.calibration`` when the file it names cannot be read as a
    calibration (missing, unreadable, another format): what every command checks before a
    rank starts, since only rank 0 reads it (for the dumps' predicted trace)."""
    path = calibration_path(plan)
    if path is None:
        return
    try:
        DeviceRates.load(path)
    except PlanError as exc:
        raise PlanError(f"cost.calibration: {exc}") from None


def device_kind(plan: Plan) -> str:
    """``cpu`` or ``cuda``: ``backend.device`` with ``auto`` resolved on this machine. What a
    rank-independent use (an estimate's default rates) needs; a rank's own device is
    :func:`rank_device`."""
    if plan.backend.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return plan.backend.device
