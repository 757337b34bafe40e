"""What converting a DeepSpeed config is made of: the plan being built, what each key
became (:class:`Outcome`), and the handlers' shared helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["mapped", "ignored", "unsupported"]


_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Outcome:
    """What one DeepSpeed key became."""

    key: str  # dotted path in the DeepSpeed config
    value: Any
    kind: Kind
    note: str  # the plan field it set, or why it was ignored, or what is not supported
    default_of: str | None = None  # an 'auto' left to zerocc: the plan field whose default applies

    def line(self) -> str:
        """``kind key = value: note``, as `zerocc plan import` prints it."""
        value = "{...}" if isinstance(self.value, dict) else json.dumps(self.value)
        value = "(not set)" if self.value is None else value
        return f"{self.kind:<11} {self.key} = {value}: {self.note}"


class Conversion:
    """The plan being built and what each key became."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.plan: dict[str, Any] = {}
        self.outcomes: list[Outcome] = []
        self.param = "fp32"  # the compute dtype, once fp16/bf16 are read

    def set(self, path: str, value: Any) -> None:
        """Set the plan field at dotted ``path``."""
        *parents, leaf = path.split(".")
        node = self.plan
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value

    def mapped(self, key: str, value: Any, path: str, plan_value: Any, note: str = "") -> None:
        self.set(path, plan_value)
        shown = json.dumps(plan_value)
        self.outcomes.append(
            Outcome(key, value, "mapped", f"{path}: {shown}" + (f" ({note})" if note else ""))
        )

    def ignored(self, key: str, value: Any, why: str) -> None:
        self.outcomes.append(Outcome(key, value, "ignored", why))

    def unsupported(self, key: str, value: Any, why: str) -> None:
        self.outcomes.append(Outcome(key, value, "unsupported", why))

    def auto(self, key: str, value: Any, default: str) -> bool:
        """Whether ``value`` is "auto" (recorded as ignored: zerocc's ``default`` applies: a
        plan field's dotted path, whose value the plan's validation fills, or words)."""
        if value == "auto":
            why = "'auto' is for Hugging Face's Trainer to fill; zerocc's default applies"
            field = default if " " not in default and "." in default else None
            self.outcomes.append(Outcome(key, value, "ignored", f"{why} ({default})", field))
            return True
        return False


Handler = Callable[[Conversion, str, Any], None]


def ignore(why: str) -> Handler:
    """A key that means nothing to zerocc, for the reason ``why``."""
    return lambda conv, key, value: conv.ignored(key, value, why)


def feature(what: str) -> Handler:
    """A DeepSpeed feature zerocc does not have: fine when disabled, else unsupported."""

    def handle(conv: Conversion, key: str, value: Any) -> None:
        enabled = value.get("enabled", True) if isinstance(value, dict) else bool(value)
        if enabled:
            conv.unsupported(key, value, f"{what}: not in zerocc; remove it or disable it")
        else:
            conv.ignored(key, value, "disabled")

    return handle


def elements_mb(conv: Conversion, elements: float) -> float:
    """DeepSpeed's sizes count elements; zerocc's count MB at the compute dtype's size."""
    return round(elements * _ITEMSIZE[conv.param] / 2**20, 3)


def number(conv: Conversion, key: str, value: Any, kinds: tuple[type, ...] = (int, float)) -> bool:
    """Whether ``value`` is a number of ``kinds`` (else the key is unsupported)."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        conv.unsupported(key, value, f"expected a number, got {json.dumps(value)}")
        return False
    return True


LOGGING = ("logging and profiling of DeepSpeed's engine; `zerocc train --metrics FILE "
           "--tensorboard DIR` records loss, lr, tokens/s and memory")  # fmt: skip
