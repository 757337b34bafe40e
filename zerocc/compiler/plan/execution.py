"""The sections that say how a step is captured and runs and what a run writes: capture,
backend, overlap, cost, offload, recompute, dumps, checkpoint and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from zerocc.compiler.plan.base import MAX_MB, PathStr, Section

if TYPE_CHECKING:
    import torch

# The longest collective timeout: a collective that waits a week is hung (and longer ones
# overflow the process group's millisecond clock for no benefit).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# The shortest: the ranks' first meeting and every collective wait on the network and on the
# slowest rank, so a timeout below a second fails healthy runs (1e-9 failed the first meeting
# with torch's DistStoreError before any step ran).
MIN_TIMEOUT_S = 1.0


class CaptureConfig(Section):
    """How the training step is traced into the graph the passes rewrite."""

    repeated_layers: bool = Field(
        True,
        description="trace a module whose instances run alike (a transformer's blocks) once "
        "and copy that trace for its other calls: the same graph as tracing every call, in a "
        "fraction of the time; false traces every call (what `zerocc inspect` prints under "
        "capture says which modules were copied)",
    )
    draws: Literal["generator", "keyed"] = Field(
        "generator",
        description="how random ops (dropout) draw: generator, from each rank's device "
        "generator in program order (eager's draws on one process); keyed, each from a "
        "generator seeded by the plan's seed, the step, the micro-batch's place in the global "
        "batch and the op's place in the step: the same masks under any pipeline cut, after a "
        "resume, and in an eager reference run under zerocc.keyed_draws",
    )


class BackendConfig(Section):
    """Which backend runs the scheduled graph, and on which device."""

    name: str = Field(
        "eager",
        description="the backend that runs the scheduled graph: eager (the reference, op by op), "
        "inductor (each compute region between zerocc's ops compiled by TorchInductor, a "
        "repeated layer's once: Triton on a GPU, C++ on a CPU; inductor-regions, its name "
        "before), inductor-whole (the whole program as one graph, zerocc's ops in it as "
        "scheduled; region by region where it cannot be whole), auto (inductor on a GPU, "
        "eager on a CPU) or one registered with "
        "zerocc.backends.register_backend",
    )
    kernels: Literal["auto", "torch", "fused", "one-pass", "triton"] = Field(
        "auto",
        description="zerocc's own kernels (optimizer update, unscale, pack): torch ops (the "
        "reference), torch's fused optimizer kernels (fused), a CPU update compiled by "
        "Inductor into one loop with its scaling and copy (one-pass: a step on the CPU; the "
        "host updates of offloaded units take it on a GPU machine anyway), or zerocc's Triton "
        "kernels (on CPU only interpreted, with TRITON_INTERPRET=1); auto: triton on a GPU "
        "when triton can run them, else fused, with fp32 masters; torch with lower-precision "
        "masters",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: cuda when this machine has a GPU, else cpu; on cuda, rank i of a "
        "machine runs on cuda:i, and a machine needs a GPU per rank",
    )
    timeout_s: float = Field(
        600,
        ge=MIN_TIMEOUT_S,
        le=MAX_TIMEOUT_S,
        description="seconds a collective may wait for its peers before every rank still "
        "running stops with an error naming the ranks that stopped answering (compilation "
        "does not count against it); from 1 (shorter waits fail healthy runs, the ranks' "
        "first meeting included) to a week (604800)",
    )
    check_memory: bool = Field(
        True,
        description="before training, compare the predicted per-rank peak with the memory "
        "this machine has and stop with the plan changes that would fit; false: go on anyway",
    )


class OverlapConfig(Section):
    """Hide communication behind compute (the overlap pass): prefetch gathers, delay waits."""

    enabled: bool = Field(
        True, description="run the overlap pass in the default pass list (losses are unchanged)"
    )
    prefetch: int = Field(
        1,
        ge=0,
        le=1024,
        description="upper bound on the units whose all-gathers are issued ahead of the unit "
        "being computed (0: gather each unit just before its use; at most 1024, more units "
        "than any model holds)",
    )
    max_inflight_mb: float | None = Field(
        None,
        gt=0,
        le=MAX_MB,
        description="memory budget of collectives in flight (issued, not yet waited on): "
        "prefetched units and gradient buckets; default: bounded by `prefetch` only",
    )
    bucket_mb: float = Field(
        0,
        ge=0,
        description="consecutive units smaller than this many MB are gathered and reduced in one "
        "collective of up to this size (0: one collective per unit)",
    )


class CostConfig(Section):
    """Device rates of the cost model behind `zerocc estimate` and the dumps' predicted trace.

    Unset rates come from ``calibration`` (a file `zerocc profile` writes), else from built-in
    defaults for the device."""

    calibration: PathStr | None = Field(
        None,
        description="JSON written by `zerocc profile PLAN`, relative to the plan file",
    )
    compute_tflops: float | None = Field(
        None, gt=0, le=1e6, description="dense compute rate, TFLOP/s (at most 1e6: an exaflop)"
    )
    memory_gb_per_s: float | None = Field(
        None, gt=0, description="memory bandwidth of elementwise ops, GB/s"
    )
    link_gbps: float | None = Field(
        None, gt=0, description="per-rank interconnect bandwidth, Gbit/s (e.g. 400 for NDR IB)"
    )
    latency_us: float | None = Field(
        None, ge=0, description="per-hop latency of a collective, microseconds (the alpha term)"
    )
    group_link_gbps: dict[
        Literal["dp", "replicate", "tp", "pp", "ep", "edp", "secondary"],
        Annotated[float, Field(gt=0)],
    ] = Field(
        default_factory=dict,
        description="per mesh group, the link bandwidth of its collectives, Gbit/s (e.g. "
        "{tp: 7200} for NVLink within a node, {replicate: 400} across nodes; pp: the sends "
        "between pipeline ranks; secondary: backward's gathers under zero.secondary_group, "
        "within a node); the other groups use link_gbps",
    )


Location = Literal["none", "cpu", "nvme"]


class OffloadConfig(Section):
    """Where model states live when they do not fit on the device (ZeRO-Offload / -Infinity).

    ``cpu``: host memory (pinned when a GPU is present); ``nvme``: files under ``nvme_path``,
    read and written by background I/O threads. On a CPU-only machine the "device" is host
    memory too: offloaded states are then accounted in their own pool."""

    optimizer: Location = Field(
        "none",
        description="where the fp32 master weights and optimizer moments of offloaded units "
        "live; their update runs there (stages 1-3)",
    )
    params: Location = Field(
        "none",
        description="stage 3: where each offloaded unit's parameter shard lives between its "
        "all-gathers; it is copied in before each gather, scheduled like a prefetch",
    )
    ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the share of the model's parameters (whole units, those whose gradients "
        "are complete first) that are offloaded; 1: every unit",
    )
    defer_updates: Literal["none", "next_forward", "delayed"] = Field(
        "none",
        description="when the host updates of offload.optimizer: cpu run. 'none': at the end "
        "of the step, which waits for them. 'next_forward': each unit's update runs on a host "
        "thread beside the next step's forward, which waits for it only right before the "
        "unit's weights are first read (stages 1-2 all-gather them then): the same numbers as "
        "'none'. 'delayed' (ZeRO-Offload's delayed parameter update): beside the next step's "
        "forward and backward, its weights first used a step later: the gradients of offloaded "
        "units are one step stale (numerics change). A save, state_dict or evaluate applies "
        "the update in flight first (under stages 1-2, an all-gather: on every rank). "
        "next_forward with one micro-batch per step",
    )
    grads: Literal["cpu", "device"] = Field(
        "cpu",
        description="where the reduced gradient shards of units whose optimizer is offloaded "
        "wait for their update, which runs after the step's last one is reduced (the overflow "
        "check and clipping read them all). 'cpu': copied to host buffers as backward reduces "
        "them (each checked for inf/NaN then), leaving the device as they go (see "
        "grads_in_flight): host memory of every shard (4 bytes per element in fp32), as "
        "DeepSpeed's and FSDP2's offload hold. 'device': they stay on the device (its memory, "
        "as without offload) and each is copied, right before its update, through one of two "
        "host buffers, the next one's copy running beside the update: host memory of two "
        "units' shards, for host memory equal to the states. offload.defer_updates: none",
    )
    grads_in_flight: int | None = Field(
        2,
        ge=1,
        description="offload.grads: cpu: how many reduced gradients' copies to the host may be "
        "in flight at once. Backward waits for a gradient's copy before the gradient this many "
        "after it is complete (when the copies are slower than backward), so the device holds "
        "at most this many plus the one being completed; each more costs a unit's gradient of "
        "device memory and waits less (zerocc estimate shows the peak and the wait). null: no "
        "bound, backward never waits and the device may hold every offloaded gradient until "
        "its copy is done",
    )
    nvme_path: PathStr | None = Field(
        None,
        description="folder for the state files of nvme offload (a fast local disk; a relative "
        "path is from the working directory); a per-run subfolder is created there and removed "
        "at exit",
    )

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded."""
        return self.optimizer != "none" or self.params != "none"

    def updates_on_host(self, device: torch.device) -> bool:
        """Whether optimizer updates run on the host beside the ``device`` that computes: the
        optimizer is offloaded and the device is a GPU (on a CPU they are the same processor).
        Such a run picks (and compiles) the host update's kernel set and times the host link."""
        return self.optimizer != "none" and device.type == "cuda"

    @property
    def uses_nvme(self) -> bool:
        """Whether any state lives in files under ``nvme_path``."""
        return "nvme" in (self.optimizer, self.params)


class RecomputeConfig(Section):
    """Activation checkpointing (the recompute pass): forward activations of chosen units are
    not kept for backward; their forward runs again right before their backward."""

    units: Literal["none", "all"] | list[str] = Field(
        "none",
        description="'all': every unit but the root (whose forward ends where backward "
        "begins); or globs over unit names, e.g. ['transformer.h.*'] ('*' stops at dots, "
        "'**' crosses them); 'none': keep "
        "every activation",
    )

    @property
    def enabled(self) -> bool:
        """Whether any unit is recomputed."""
        return self.units != "none" and self.units != []


class DumpsConfig(Section):
    """Files that show what the compiler built and what a run did (see zerocc.inspect.dumps)."""

    dir: PathStr | None = Field(
        None,
        description="folder for per-pass programs (.py, .dot), the measured trace, memory "
        "plots and report.html; ZEROCC_DUMP_DIR overrides it",
    )


class CheckpointConfig(Section):
    """Checkpoints `zerocc train` saves and resumes from (`TrainStep.save` / `load`): by model
    name, loadable under any world size or stage."""

    dir: PathStr | None = Field(
        None,
        description="folder `zerocc train` saves checkpoints to (step-<n> folders, a 'latest' "
        "file naming the newest): at the end of training, every `every` steps, and on SIGTERM or "
        "Ctrl-C; none: no saves",
    )
    every: int = Field(
        0,
        ge=0,
        description="optimizer steps between saves; 0: only at the end and on SIGTERM or Ctrl-C",
    )
    keep: int | None = Field(
        3, ge=1, description="newest checkpoints kept in `dir`, older ones deleted; null: all"
    )
    resume: PathStr | None = Field(
        None,
        description="checkpoint to start from: a step-<n> folder, or a folder of them (its "
        "newest); the data goes on where that run stopped",
    )
    in_memory: bool = Field(
        False,
        description="also keep every step's state in host memory (a tmpfs folder under "
        "/dev/shm, removed when `zerocc train` ends), so that a restart (`zerocc train "
        "--max-restarts`) loses no step: each rank's state in its machine's memory and, "
        "over several machines (--nnodes), in the next machine's, so a lost machine's ranks "
        "are restored from its neighbour's copies (sent on a thread during the next step: a "
        "machine lost before they arrive loses that step too); a write at memory speed per "
        "step, two of each held. A restart on another number of ranks (--nnodes MIN:N, "
        "--nproc-min) writes them out as a disk checkpoint and loads it resharded",
    )
    async_save: Literal["auto"] | bool = Field(
        "auto",
        description="write checkpoints in the background: training waits only while the "
        "state is copied to host memory, and a thread writes, hashes and commits it during "
        "the next steps (the save on a stop or at the end is waited for); auto: when every "
        "rank's copy fits in half the host memory available at the first save",
    )


class MetricsConfig(Section):
    """What `zerocc train` reports as it trains: the progress line, a JSONL file, TensorBoard,
    and an evaluation loss on the workload's held-back data."""

    every: int = Field(
        1,
        ge=1,
        description="optimizer steps per record: the loss (mean over ranks and the steps since "
        "the last record), learning rate, tokens/s and, on GPUs, MFU and peak memory",
    )
    file: PathStr | None = Field(
        None, description="JSONL file rank 0 appends one record to per `every` steps"
    )
    tensorboard: PathStr | None = Field(
        None,
        description="TensorBoard log folder rank 0 writes the same records to (needs the "
        "tensorboard package: pip install tensorboard)",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="optimizer steps between evaluations (and one at the end) of the loss on "
        "the workload's eval_batches, forward only; 0: none",
    )
    eval_batches: int | None = Field(
        None, ge=1, description="batches per rank an evaluation reads; null: all of them"
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="the device's dense peak TFLOP/s for MFU (default: the datasheet's for "
        "known GPUs in the compute dtype; MFU is not shown where it is unknown)",
    )
