"""The plan: a YAML file that says how to shard, optimize and run one training step."""

from zerocc.compiler.plan.model import (
    DTYPES,
    HOST_LOCAL,
    MAX_LOSS_SCALE,
    OffloadConfig,
    OptimizerConfig,
    Plan,
    PrecisionConfig,
    ScheduleConfig,
    TpLayer,
    load_plan,
    plan_json_schema,
)

__all__ = [
    "DTYPES",
    "HOST_LOCAL",
    "MAX_LOSS_SCALE",
    "OffloadConfig",
    "OptimizerConfig",
    "Plan",
    "PrecisionConfig",
    "ScheduleConfig",
    "TpLayer",
    "load_plan",
    "plan_json_schema",
]
