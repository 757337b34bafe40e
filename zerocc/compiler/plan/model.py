"""The plan: a YAML file that says how to shard, optimize and run one training step.

A tree of pydantic models, one per section (:mod:`.parallelism`, :mod:`.optimizer`,
:mod:`.precision`, :mod:`.execution`), and here the :class:`Plan` that holds them and the checks
across sections; :func:`~zerocc.compiler.plan.load.load_plan` turns any invalid input into one
`PlanError` naming the file, the YAML path of each bad field, the bad value and what is allowed
there.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator

from zerocc.compiler.plan.base import Section
from zerocc.compiler.plan.execution import (
    BackendConfig,
    CaptureConfig,
    CheckpointConfig,
    CostConfig,
    DumpsConfig,
    MetricsConfig,
    OffloadConfig,
    OverlapConfig,
    RecomputeConfig,
)
from zerocc.compiler.plan.optimizer import OptimizerConfig
from zerocc.compiler.plan.parallelism import (
    AUTO_UNITS,
    ParallelConfig,
    UnitsConfig,
    ZeroConfig,
    check_layout,
)
from zerocc.compiler.plan.pipeline import PipelineConfig, check_schedule
from zerocc.compiler.plan.precision import PrecisionConfig
from zerocc.compiler.plan.renamed import RENAMED_FIELDS, read_renamed
from zerocc.errors import PlanError

MAX_LEAST_WORLD = 4096  # (least_world_size looks no further)
_WORKLOAD_SHAPE = re.compile(r"^([A-Za-z_]\w*(\.[A-Za-z_]\w*)*|[^:]+\.py):[A-Za-z_]\w*$")


# Plan fields each host may set its own way: folders on its own disks, files only rank 0 writes,
# and the workload (its data is each rank's own; its model is held to the other ranks' by their
# agreement on each compiled program). The ranks agree on every other field (Plan.shared_lines).
HOST_LOCAL = frozenset(
    {
        "offload.nvme_path",
        "dumps.dir",
        "checkpoint.dir",
        "checkpoint.resume",
        "metrics.file",
        "metrics.tensorboard",
        "cost.calibration",
        "workload",
        "workload_args",
    }
)


def _shared_lines(value: Any, path: str = "") -> list[str]:
    """``path: value`` lines of a plan's (JSON) fields under ``path``, none of HOST_LOCAL."""
    if path in HOST_LOCAL:
        return []
    if isinstance(value, dict) and value:
        return [line for k, v in value.items() for line in _shared_lines(v, _joined(path, k))]
    return [f"{path}: {value!r}"]


def _joined(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Plan(Section):
    """A zerocc plan: how to shard, optimize and run one training step."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        for old, new in RENAMED_FIELDS.items():
            data = read_renamed(data, old.split("."), old, new)
        if isinstance(data, dict) and data.get("units") == AUTO_UNITS:  # `units: auto`
            data = {**data, "units": {"classes": [AUTO_UNITS]}}
        return data

    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage and world size")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="tensor parallelism beside ZeRO: the mesh's dp × tp and the layers split",
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="pipeline parallelism (parallel.pp > 1): schedule, micro-batches, stages",
    )
    units: UnitsConfig = Field(
        default_factory=UnitsConfig, description="how parameters are grouped into FSDP units"
    )
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="optimizer and gradient clipping"
    )
    grad_accumulation: int = Field(
        1,
        ge=1,
        le=2**20,
        description="micro-batches per optimizer step; the gradient is the mean over ranks and "
        "micro-batches (at most 2^20: no run reaches a step of more)",
    )
    precision: PrecisionConfig = Field(
        default_factory=PrecisionConfig, description="dtypes of parameters and gradients"
    )
    capture: CaptureConfig = Field(
        default_factory=CaptureConfig, description="how the step is traced: repeated layers"
    )
    backend: BackendConfig = Field(
        default_factory=BackendConfig, description="which backend runs the scheduled graph"
    )
    overlap: OverlapConfig = Field(
        default_factory=OverlapConfig,
        description="overlap of communication with compute: prefetch, budget, buckets",
    )
    cost: CostConfig = Field(
        default_factory=CostConfig, description="device rates of the cost model (estimates)"
    )
    offload: OffloadConfig = Field(
        default_factory=OffloadConfig,
        description="optimizer states and parameters in host memory or on NVMe",
    )
    recompute: RecomputeConfig = Field(
        default_factory=RecomputeConfig,
        description="activation checkpointing: which units' forward is recomputed in backward",
    )
    dumps: DumpsConfig = Field(
        default_factory=DumpsConfig, description="where to write inspection dumps, if anywhere"
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="training checkpoints: where `zerocc train` saves, how often, what it resumes",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="what `zerocc train` records: progress line, JSONL, TensorBoard, eval loss",
    )
    passes: list[str] | None = Field(
        None,
        description="pass list in order; default: every pass the plan's sections turn on "
        "(partition, shard, optimizer always; recompute, precision, overlap and offload when "
        "their sections ask), in the order the passes' contracts allow",
    )
    workload: str | None = Field(
        None,
        description="'module:function' (or 'path/to/file.py:function', the file relative to the "
        "plan's folder) returning a zerocc Workload. It is code: importing and "
        "calling it runs it, as running a training script would. The module is looked up in the "
        "plan file's folder first, then in installed packages (sys.path), never in the current "
        "directory unless it is the plan's folder; a plan given as a dict has no folder, so "
        "installed packages only",
        json_schema_extra={"pattern": _WORKLOAD_SHAPE.pattern},
    )
    workload_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments passed to the workload function"
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="seed for deterministic initialization of models built on the meta device "
        "(0 to 2^63 - 1, what torch's generators take)",
    )

    # Not a field: it is where the plan came from, never something a plan file may set.
    _source: str | None = PrivateAttr(default=None)

    @property
    def source(self) -> str | None:
        """The path the plan was loaded from (None for a dict or Plan); the workload module is
        looked up in its folder first (see zerocc.compiler.workload.load_workload)."""
        return self._source

    def shared_lines(self) -> str:
        """The plan as ``field: value`` lines (the YAML path of each field), every field but
        those a host may set its own way (:data:`HOST_LOCAL`): what the ranks must run alike.
        A learning rate or schedule that differs across ranks changes no compiled program,
        only the numbers each rank's shard is updated by."""
        top = {name for name in HOST_LOCAL if "." not in name}  # workload_args may hold objects
        return "\n".join(_shared_lines(self.model_dump(mode="json", exclude=top)))

    def check_world_size(self, world_size: int) -> None:
        """A PlanError when ``world_size`` ranks cannot take this plan's layout (``parallel.dp``
        and ``tp``, ``zero.replicate``); the layout itself is
        :meth:`zerocc.compiler.parallel.mesh.Mesh.of_plan`."""
        dp, tp, pp = self.parallel.dp, self.parallel.tp, self.parallel.pp
        if dp is not None and dp * tp * pp != world_size:
            factors = f"dp {dp} × tp {tp}" + (f" × pp {pp}" if pp > 1 else "")
            product = "dp × tp" + (" × pp" if pp > 1 else "")
            raise PlanError(
                f"parallel: {factors} is {dp * tp * pp} ranks, but the world size is "
                f"{world_size}; allowed: {product} = {world_size} (or leave dp out)"
            )
        zero = self.zero
        check_layout(world_size, zero.replicate, tp, pp, self.parallel.ep, zero.secondary_group)

    def least_world_size(self) -> int:
        """The fewest ranks (2 or more) this plan's layout takes: ``zero.world_size`` when it
        sets one, else the smallest world ``parallel`` and ``zero.replicate`` divide into
        groups of their sizes (2 for a plan that lays out nothing)."""
        if self.zero.world_size is not None:
            return self.zero.world_size
        for world_size in range(2, MAX_LEAST_WORLD + 1):
            try:
                self.check_world_size(world_size)
            except PlanError:
                continue
            return world_size
        raise PlanError(f"parallel: this layout takes no world of up to {MAX_LEAST_WORLD} ranks")

    @model_validator(mode="after")
    def _stage_3_units_are_auto_by_default(self) -> Plan:
        """A stage-3 plan that names no units gets the model's repeated block (one unit would
        gather the whole model at once)."""
        units = self.units
        if self.zero.stage == 3 and not (units.classes or units.modules or units.min_mb):
            self.units = units.model_copy(update={"classes": [AUTO_UNITS]})
        return self

    @model_validator(mode="after")
    def _mesh_takes_the_world(self) -> Plan:
        if self.zero.world_size is not None:  # a layout the ranks cannot take is an error now
            self.check_world_size(self.zero.world_size)
        return self

    @model_validator(mode="after")
    def _pipeline_has_stages(self) -> Plan:
        pp, pipeline = self.parallel.pp, self.pipeline
        if pp == 1:  # (against the defaults: a plan dumped and loaded sets every field)
            if pipeline != PipelineConfig():
                raise ValueError(
                    "pipeline: a schedule for a pipeline of one stage; set parallel.pp to 2 or "
                    "more ranks, or drop the pipeline section"
                )
            return self
        check_schedule(
            pipeline.schedule, pp, pipeline.microbatches_of(pp), pipeline.stages_per_rank_of()
        )
        if self.units.blocks_per_unit > 1:
            raise ValueError(
                f"units.blocks_per_unit: {self.units.blocks_per_unit} with parallel.pp: {pp}: "
                "a pipeline's stages are cut at units of one module each; drop it (the "
                "stages' units are gathered once a step already, pipeline.gather: step)"
            )
        if self.grad_accumulation > 1:
            raise ValueError(
                f"grad_accumulation: {self.grad_accumulation} with parallel.pp: {pp}: a "
                "pipeline accumulates its micro-batches' gradients already; set "
                f"pipeline.microbatches (now {pipeline.microbatches_of(pp)}) instead"
            )
        if pipeline.gather != "step" and not self.zero.shards_params:
            raise ValueError(
                f"pipeline.gather: {pipeline.gather} applies to zero.stage 3 only: stage "
                f"{self.zero.stage} holds every parameter whole; drop it or set zero.stage: 3"
            )
        if (
            pipeline.gather == "step"
            and self.zero.shards_params
            and (self.units.keep_gathered or self.units.keep_gathered_below_mb)
        ):
            raise ValueError(
                "units.keep_gathered with pipeline.gather: step: every unit of a stage is "
                "gathered once per step and kept already; drop it, or set pipeline.gather: "
                "microbatch to keep these units gathered through each micro-batch's program"
            )
        if pipeline.gather == "step" and self.offload.params != "none":
            raise ValueError(
                f"offload.params: {self.offload.params} with pipeline.gather: step: a stage's "
                "parameters gathered once per step are held whole on the device through it; "
                "set pipeline.gather: microbatch to keep their shards off the device between "
                "uses, or drop offload.params"
            )
        stages = pp * pipeline.stages_per_rank_of()
        if isinstance(pipeline.split, list) and len(pipeline.split) != stages - 1:
            raise ValueError(
                f"pipeline.split names {len(pipeline.split)} units, but {stages} stages "
                f"(parallel.pp {pp} × stages_per_rank {pipeline.stages_per_rank_of()}) begin "
                f"at {stages - 1} units after the first; name {stages - 1}, or split: auto"
            )
        return self

    @model_validator(mode="after")
    def _kernels_update_fp32_masters(self) -> Plan:
        if self.backend.kernels == "triton" and self.precision.master != "fp32":
            raise ValueError(
                "backend.kernels: triton updates fp32 master weights; precision.master: "
                f"{self.precision.master} needs backend.kernels: torch"
            )
        return self

    @model_validator(mode="after")
    def _keep_gathered_is_stage_3(self) -> Plan:
        units = self.units
        if not self.zero.shards_params and (units.keep_gathered or units.keep_gathered_below_mb):
            raise ValueError(
                f"units.keep_gathered applies to stage 3 only: stage {self.zero.stage} keeps "
                "every parameter resident; drop it or set zero.stage: 3"
            )
        return self

    @model_validator(mode="after")
    def _offload_fits_the_stage(self) -> Plan:
        offload, stage = self.offload, self.zero.stage
        if offload.optimizer != "none" and not self.zero.shards_optimizer:
            raise ValueError(
                f"offload.optimizer: {offload.optimizer} needs a sharded optimizer (zero.stage "
                "1, 2 or 3); stage 0 keeps every optimizer state on every rank"
            )
        if offload.params != "none" and not self.zero.shards_params:
            raise ValueError(
                f"offload.params: {offload.params} needs zero.stage: 3 (stage {stage} keeps "
                "every parameter resident on the device)"
            )
        if offload.uses_nvme and not offload.nvme_path:
            raise ValueError("offload to nvme needs offload.nvme_path: a folder on a local disk")
        # (Against the default, not the fields set: a plan dumped and loaded sets them all.)
        bound_set = offload.grads_in_flight != OffloadConfig.model_fields["grads_in_flight"].default
        if bound_set and (offload.grads != "cpu" or offload.optimizer == "none"):
            raise ValueError(
                "offload.grads_in_flight bounds the copies of offload.grads: cpu (gradients of "
                "an offloaded optimizer copied to the host as backward reduces them); set "
                "offload.optimizer: cpu or nvme with offload.grads: cpu, or drop grads_in_flight"
            )
        if offload.grads == "device":
            if offload.optimizer == "none":
                raise ValueError(
                    "offload.grads: device places the gradients of an offloaded optimizer's "
                    "update, but offload.optimizer is none; set offload.optimizer: cpu or nvme, "
                    "or drop offload.grads"
                )
            if offload.defer_updates != "none":
                raise ValueError(
                    "offload.grads: device needs offload.defer_updates: none (a deferred update "
                    "reads its gradients in the next step, from host buffers kept for it); "
                    "or set offload.grads: cpu"
                )
        if offload.defer_updates != "none":
            needs = {
                "offload.optimizer: cpu (the update it carries runs in host memory)": (
                    offload.optimizer == "cpu"
                ),
                "grad_accumulation: 1 (a step's first micro-batches would compute on the "
                "weights before the update its last one waits for; 'delayed' takes more)": (
                    self.grad_accumulation == 1 or offload.defer_updates == "delayed"
                ),
            }
            precision = self.precision
            if offload.defer_updates == "delayed" and offload.params == offload.optimizer:
                # No compute copy apart from the weights the update writes (fp32 states and
                # parameters together): the step would read them while the update writes.
                needs["a compute copy apart from the weights the update writes (precision.param "
                      "below precision.master, or offload.params: none)"] = (
                    precision.dtype("param") != precision.dtype("master")
                )  # fmt: skip
            missing = [need for need, met in needs.items() if not met]
            if missing:
                raise ValueError(
                    f"offload.defer_updates: {offload.defer_updates} needs "
                    + "; and ".join(missing)
                    + "; or set offload.defer_updates: none"
                )
        return self

    @field_validator("workload")
    @classmethod
    def _workload_shape(cls, workload: str | None) -> str | None:
        if workload is not None and not _WORKLOAD_SHAPE.match(workload):
            raise ValueError(
                f"{workload!r} is not of the form 'module:function' or 'path/to/file.py:"
                "function' (e.g. 'workload:workload')"
            )
        return workload
