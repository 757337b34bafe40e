"""The plan: a YAML file that says how to shard, optimize and run one training step.

The sections are pydantic models by theme (:mod:`.parallelism`, :mod:`.optimizer`,
:mod:`.precision`, :mod:`.execution`, on the base of :mod:`.base`), held by the :class:`Plan`
(:mod:`.model`); :mod:`.load` reads plan files (:mod:`.yaml_file`), DeepSpeed configs
(:mod:`.deepspeed`) and renamed fields (:mod:`.renamed`), and :mod:`.messages` words what is
wrong. The package imports nothing of the compiler's other modules: only errors and the IR.
"""

from zerocc.compiler.plan.base import FP32_TINY, PathStr
from zerocc.compiler.plan.execution import (
    MAX_TIMEOUT_S,
    BackendConfig,
    CaptureConfig,
    CheckpointConfig,
    CostConfig,
    DumpsConfig,
    Location,
    MetricsConfig,
    OffloadConfig,
    OverlapConfig,
    RecomputeConfig,
)
from zerocc.compiler.plan.load import load_plan, plan_json_schema
from zerocc.compiler.plan.model import HOST_LOCAL, Plan
from zerocc.compiler.plan.optimizer import MAX_LR, SCHEDULE_FIELDS, OptimizerConfig, ScheduleConfig
from zerocc.compiler.plan.parallelism import (
    ParallelConfig,
    TpLayer,
    TpStyle,
    UnitsConfig,
    ZeroConfig,
    check_layout,
)
from zerocc.compiler.plan.precision import (
    DTYPE_NAMES,
    MAX_LOSS_SCALE,
    Dtype,
    Float8Config,
    LossScaleConfig,
    PrecisionConfig,
)
from zerocc.compiler.plan.renamed import RENAMED_FIELDS

__all__ = [
    "DTYPE_NAMES",
    "FP32_TINY",
    "HOST_LOCAL",
    "MAX_LOSS_SCALE",
    "MAX_LR",
    "MAX_TIMEOUT_S",
    "RENAMED_FIELDS",
    "SCHEDULE_FIELDS",
    "BackendConfig",
    "CaptureConfig",
    "CheckpointConfig",
    "CostConfig",
    "Dtype",
    "DumpsConfig",
    "Location",
    "Float8Config",
    "LossScaleConfig",
    "MetricsConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "OverlapConfig",
    "ParallelConfig",
    "PathStr",
    "Plan",
    "PrecisionConfig",
    "RecomputeConfig",
    "ScheduleConfig",
    "TpLayer",
    "TpStyle",
    "UnitsConfig",
    "ZeroConfig",
    "check_layout",
    "load_plan",
    "plan_json_schema",
]
