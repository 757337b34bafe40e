"""float8 matmuls (``precision.matmul: fp8``): the plan's linear layers computed in float8.

The layers are torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``, the
recipe ``precision.fp8.recipe`` names): each forward scales its input and its weight into
float8 (e4m3), multiplies them with ``torch._scaled_mm`` and returns the compute dtype; its
backward does the same for the input's and the weight's gradients (the output's gradient in
e5m2 under ``tensorwise``). Its forward and backward are ordinary autograd code on plain
tensors, so the whole-step capture traces them like any layer: the step's graph holds the
``amax`` reductions, the casts and the ``_scaled_mm`` calls, which the passes schedule and the
backends compile; the weights stay ordinary parameters (sharded, gathered, reduced and
checkpointed as before, their FQNs unchanged), and the masters keep their precision.

The layers are converted in place, before capture, once per model (a later session on the same
model finds them converted, with the same recipe or a PlanError). Which layers: those
``precision.fp8.layers`` names, else every ``nn.Linear`` whose in and out features are
multiples of 16 (what the float8 kernels take) but the model's last (its output head) and
those tensor parallelism splits (its styles compute a split layer themselves). A
subclass of ``nn.Linear`` is converted when its forward is ``nn.Linear``'s (one that only
initializes its weights its own way keeps that initialization: a model built on the meta
device is initialized by each module's ``reset_parameters`` after this).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerocc.compiler.names import glob_matches
from zerocc.compiler.plan import Plan
from zerocc.errors import PlanError
from zerocc.logs import torchao_import_quiet

ALIGN = 16  # the float8 matmul kernels need both dimensions of a weight to be multiples of it
# The GPUs with float8 matmuls: compute capability 8.9 (Ada: L4, L40, RTX 40xx) and 9.0 (H100,
# H200) on; B200 and later too.
FLOAT8_CAPABILITY = (8, 9)
INSTALL = "pip install 'zerocc[fp8]' (torchao)"


@dataclass(frozen=True)
class Float8Layers:
    """The layers a plan computes in float8 (converted), and the linear layers it leaves in
    the compute dtype with why."""

    recipe: str
    layers: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (FQN, why)

    @staticmethod
    def convert(model: nn.Module, plan: Plan) -> Float8Layers | None:
        """Convert ``model``'s chosen linear layers to float8 under ``plan`` (None without
        ``precision.matmul: fp8``); PlanError as :meth:`chosen` says."""
        layers = Float8Layers.chosen(model, plan)
        if layers is None:
            return None
        with torchao_import_quiet():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear import Float8Linear
        config = Float8LinearConfig.from_recipe_name(layers.recipe)
        before = dict(model.named_modules())
        fresh = {fqn for fqn in layers.layers if not isinstance(before[fqn], Float8Linear)}
        convert_to_float8_training(
            model, module_filter_fn=lambda m, fqn: fqn in fresh, config=config
        )
        modules = dict(model.named_modules())
        for fqn in fresh:  # a subclass's own initialization stays (a meta model's is run later)
            init = type(before[fqn]).reset_parameters
            if init is not nn.Linear.reset_parameters:
                modules[fqn].reset_parameters = types.MethodType(init, modules[fqn])
        return layers

    @staticmethod
    def chosen(model: nn.Module, plan: Plan) -> Float8Layers | None:
        """The layers :meth:`convert` would convert, ``model`` left as it is (``zerocc plan
        check``'s question; None without ``precision.matmul: fp8``); PlanError for a glob that
        matches no linear layer, a layer the float8 kernels cannot take (one tensor
        parallelism splits among them), no layer to convert at all, a model converted under
        another recipe, and a machine without torchao."""
        if plan.precision.matmul != "fp8":
            return None
        try:
            with torchao_import_quiet():
                from torchao.float8 import Float8LinearConfig
                from torchao.float8.float8_linear import Float8Linear
        except ImportError as e:
            raise PlanError(f"precision.matmul: fp8 computes with torchao's float8 layers: "
                            f"{INSTALL}") from e  # fmt: skip
        fp8 = plan.precision.fp8
        config = Float8LinearConfig.from_recipe_name(fp8.recipe)

        split = list(plan.parallel.tp_layers) if plan.parallel.tp > 1 else []

        def why_not(fqn: str, m: nn.Linear) -> str | None:
            """Why ``m`` cannot be converted (None: it can, or is already, by this recipe)."""
            if any(glob_matches(fqn, pattern) for pattern in split):
                return "split by parallel.tp (its style computes the layer itself)"
            if isinstance(m, Float8Linear) and m.config != config:
                return f"converted already, under another recipe than {fp8.recipe}"
            if not isinstance(m, Float8Linear) and type(m).forward is not nn.Linear.forward:
                return f"a {type(m).__name__}, whose forward is not nn.Linear's"
            if m.in_features % ALIGN or m.out_features % ALIGN:
                return (
                    f"{m.in_features} -> {m.out_features} features, not multiples of {ALIGN} "
                    "(the float8 kernels need them)"
                )
            return None

        linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
        chosen, kept = _chosen(linears, fp8.layers, why_not)
        return Float8Layers(fp8.recipe, tuple(chosen), tuple(kept))

    def check_device(self, device: torch.device) -> None:
        """PlanError on a GPU without float8 matmuls, naming it and what would work."""
        if device.type != "cuda":
            return
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise PlanError(
                f"precision.matmul: fp8 on {device} ({name}, compute capability "
                f"{capability[0]}.{capability[1]}): it has no float8 matmuls; they need "
                f"{FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} or newer (L4, L40, H100, "
                "H200, B200); on this GPU use precision.matmul: param with param: bf16"
            )

    def describe(self, device_type: str) -> str:
        """What explain() says: the recipe, the layers and those left out, and on a CPU that
        the float8 matmuls are emulated."""
        kept = "; ".join(f"{fqn} ({why})" for fqn, why in self.kept) or "none"
        where = (
            "emulated on the CPU (torch's reference _scaled_mm: the numbers a GPU computes, "
            "about a thousand times slower than an fp32 matmul: for checking numerics)"
            if device_type == "cpu"
            else "on float8 tensor cores"
        )
        return (
            f"float8 matmuls ({self.recipe}, torchao's Float8Linear), {where}: "
            f"{len(self.layers)} layers ({_some(self.layers)}); left in the compute dtype: "
            f"{kept}"
        )


def _chosen(
    linears: dict[str, nn.Linear],
    patterns: list[str],
    why_not: Callable[[str, nn.Linear], str | None],
) -> tuple[list[str], list[tuple[str, str]]]:
    """The linear layers to convert (in model order), and those left with why."""
    if patterns:
        named: set[str] = set()
        for pattern in patterns:
            hits = {fqn for fqn in linears if glob_matches(fqn, pattern)}
            if not hits:
                raise PlanError(
                    f"precision.fp8.layers: {pattern!r} matches no nn.Linear; the model's are: "
                    f"{_some(tuple(linears), 8) or 'none'}"
                )
            named |= hits
        for fqn in named:
            if (why := why_not(fqn, linears[fqn])) is not None:
                raise PlanError(f"precision.fp8.layers: {fqn} is {why}; leave it out")
        kept = [(fqn, "not in precision.fp8.layers") for fqn in linears if fqn not in named]
        return [fqn for fqn in linears if fqn in named], kept
    if not linears:
        raise PlanError("precision.matmul: fp8 multiplies nn.Linear layers; the model has none")
    *body, head = linears
    kept = [(head, "the output head")]
    chosen = []
    for fqn in body:
        why = why_not(fqn, linears[fqn])
        if why is None:
            chosen.append(fqn)
        else:
            kept.append((fqn, why))
    if not chosen:
        reasons = "; ".join(f"{fqn}: {why}" for fqn, why in kept[:4])
        raise PlanError(
            f"precision.matmul: fp8 finds no linear layer to multiply in float8 ({reasons}); "
            "name some in precision.fp8.layers, or drop precision.matmul"
        )
    return chosen, kept


def _some(names: tuple[str, ...], shown: int = 4) -> str:
    """A few names, and how many more."""
    more = f", … ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
