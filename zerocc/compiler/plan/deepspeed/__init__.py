"""DeepSpeed configs (``ds_config.json``) read as zerocc plans, key by key: :mod:`.config`
converts the whole config, with the handlers of :mod:`.precision`, :mod:`.zero` and
:mod:`.optimizer` on the machinery of :mod:`.conversion`."""

from zerocc.compiler.plan.deepspeed.config import (
    convert,
    is_deepspeed_config,
    plan_from_deepspeed,
    read_json,
)
from zerocc.compiler.plan.deepspeed.conversion import Outcome

__all__ = ["Outcome", "convert", "is_deepspeed_config", "plan_from_deepspeed", "read_json"]
