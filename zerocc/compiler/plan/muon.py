"""Muon's part of the optimizer section: ``optimizer.groups`` (which parameters take Muon and
which AdamW, by glob over parameter names) and the hyperparameters torch.optim.Muon names that
no other optimizer reads (``ns_coefficients``, ``ns_steps``, ``adjust_lr_fn``).

A parameter no group names follows Moonlight's convention
(:func:`zerocc.compiler.passes.support.owners.muon_params`): hidden 2-D matrices take Muon;
embeddings, the output head, norms and biases take AdamW, with ``optimizer.betas``, eps
:data:`ADAMW_EPS`, ``optimizer.lr`` and ``optimizer.weight_decay`` unless a group sets its own.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from zerocc.compiler.plan.base import FP32_TINY, Section

Beta = Annotated[float, Field(ge=0, lt=1)]

# torch.optim.Muon's defaults, where they differ from the optimizer section's own.
MUON_DEFAULTS = {
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "eps": 1e-7,
    "betas": (0.9, 0.95),  # the AdamW part's: Moonlight's
}
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's, torch's default
NS_STEPS = 5
ADAMW_EPS = 1e-8  # the AdamW part's eps, unless a group sets it (Muon's eps is optimizer.eps)
MUON_FIELDS = ("betas", "eps", "weight_decay", "momentum", "nesterov", "ns_coefficients",
               "ns_steps", "adjust_lr_fn", "groups")  # fmt: skip


class ParamGroup(Section):
    """Parameters (by glob over their names, any of a tied parameter's) and the optimizer they
    take under ``optimizer.name: muon``. The first group a parameter matches decides."""

    params: list[str] = Field(
        min_length=1,
        description="globs over parameter names ('*' within a dotted component, '**' across "
        "dots): transformer.h.*.attn.c_attn.weight, **.bias",
    )
    name: Literal["muon", "adamw"] = Field(
        description="muon: orthogonalized whole (2-D parameters only); adamw: elementwise"
    )
    lr: float | None = Field(
        None,
        ge=FP32_TINY,
        le=1.0,
        description="adamw groups: their peak rate (the schedule scales it as optimizer.lr's); "
        "default optimizer.lr",
    )
    betas: tuple[Beta, Beta] | None = Field(
        None, description="adamw groups: the moments' betas; default optimizer.betas"
    )
    eps: float | None = Field(
        None, ge=FP32_TINY, le=1.0, description="adamw groups: epsilon; default 1e-8"
    )
    weight_decay: float | None = Field(
        None, ge=0, description="adamw groups: decoupled weight decay; default optimizer's"
    )

    @model_validator(mode="after")
    def _muon_takes_the_optimizers_values(self) -> ParamGroup:
        set_here = sorted(self.model_fields_set - {"params", "name"})
        if self.name == "muon" and set_here:
            raise ValueError(
                f"{', '.join(set_here)}: a muon group takes the optimizer's own values "
                "(optimizer.lr, weight_decay, momentum, ...); only adamw groups set their own"
            )
        return self
