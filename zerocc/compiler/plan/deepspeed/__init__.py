"""DeepSpeed configs (``ds_config.json``) read as zerocc plans, key by key."""

from zerocc.compiler.plan.deepspeed.config import (
    Outcome,
    convert,
    is_deepspeed_config,
    plan_from_deepspeed,
    read_json,
)

__all__ = ["Outcome", "convert", "is_deepspeed_config", "plan_from_deepspeed", "read_json"]
