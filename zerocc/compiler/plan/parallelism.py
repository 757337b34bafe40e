"""The sections that say how the ranks divide the model: ZeRO's stage and hybrid sharding
(``zero``), tensor parallelism (``parallel``) and the FSDP units (``units``); and whether a
number of ranks can take the layout they ask for."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zerocc.compiler.plan.base import MAX_MB, Section
from zerocc.errors import PlanError


class ZeroConfig(Section):
    """Which ZeRO stage to apply, and over how many ranks."""

    stage: Literal[0, 1, 2, 3] = Field(
        3, description="0: DDP; 1: shard optimizer state; 2: and gradients; 3: and parameters"
    )
    world_size: int | None = Field(
        None,
        ge=1,
        le=2**20,
        description="expected world size; compile fails clearly under any other (at most 2^20 "
        "ranks)",
    )
    replicate: int = Field(
        1,
        ge=1,
        description="hybrid sharding (HSDP): shard each unit over groups of world_size / "
        "replicate consecutive ranks and keep this many replicas, gradients all-reduced across "
        "them (stages 1-3; 1: shard over every rank)",
    )
    quantized_weights: Literal["none", "int8", "fp8"] = Field(
        "none",
        description="stage 3: all-gather the parameters in 8 bits (ZeRO++'s qwZ), each rank's "
        "shard quantized in blocks of 256 with one fp32 scale each, and dequantized to the "
        "compute dtype after the gather: 1/4 of fp32's bytes (1/2 of bf16's). int8 rounds each "
        "gathered weight to 1/254 of its block's largest; fp8 (float8 e4m3) to 1/16 of its "
        "own magnitude, finer near zero. The shards the update writes keep their precision",
    )
    secondary_group: int = Field(
        1,
        ge=1,
        description="stage 3: keep a second copy of each unit's parameters over groups of this "
        "many consecutive ranks of its shard group (ZeRO++'s hpZ; the ranks of a node): "
        "forward all-gathers over the whole shard group and each rank keeps its 1/G of what "
        "it gathered, from which backward all-gathers inside its group of G. 1: off",
    )
    quantized_grads: Literal["none", "int8", "int4"] = Field(
        "none",
        description="stages 1-3: reduce-scatter the gradients quantized (ZeRO++'s qgZ): each "
        "rank's chunk for each shard quantized in blocks of 256 with one fp32 scale each, "
        "exchanged by all-to-all and summed in fp32 on arrival. int8: 1/4 of fp32's bytes "
        "(1/2 of bf16's), each rank's contribution rounded to 1/254 of its block's largest; "
        "int4: 1/8 of fp32's (1/4 of bf16's), rounded to 1/14 of it",
    )

    @property
    def shards_optimizer(self) -> bool:
        """Stages 1-3: each rank updates its shard of every unit, and holds only the shard's
        optimizer states and master weights (stage 0: every rank updates the whole unit)."""
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Stages 2-3: gradients are reduce-scattered and each rank keeps its shard of them
        (stages 0-1: the whole gradient, all-reduced in place)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Stage 3: each rank holds its shard of the parameters between their all-gathers
        (stages 0-2: every parameter resident)."""
        return self.stage == 3

    @model_validator(mode="after")
    def _replicas_are_sharded(self) -> ZeroConfig:
        if self.replicate > 1 and not self.shards_optimizer:
            raise ValueError(
                f"replicate: {self.replicate} replicates shard groups, but stage 0 shards "
                "nothing (every rank is a replica already); set zero.stage: 1, 2 or 3"
            )
        return self

    @model_validator(mode="after")
    def _quantized_weights_are_gathered(self) -> ZeroConfig:
        if self.quantized_weights != "none" and not self.shards_params:
            raise ValueError(
                f"quantized_weights: {self.quantized_weights} quantizes stage 3's all-gathers of "
                f"the parameters; stage {self.stage} gathers none: set zero.stage: 3 or drop it"
            )
        return self

    @model_validator(mode="after")
    def _secondary_group_is_gathered_from(self) -> ZeroConfig:
        if self.secondary_group > 1 and not self.shards_params:
            raise ValueError(
                f"secondary_group: {self.secondary_group} keeps a second copy of stage 3's "
                f"parameter shards for backward's all-gathers; stage {self.stage} gathers none: "
                "set zero.stage: 3 or drop it"
            )
        return self

    @model_validator(mode="after")
    def _quantized_grads_are_reduce_scattered(self) -> ZeroConfig:
        if self.quantized_grads != "none" and not self.shards_optimizer:
            raise ValueError(
                f"quantized_grads: {self.quantized_grads} quantizes the reduce-scatters of "
                "stages 1-3; stage 0 all-reduces its gradients: set zero.stage: 1, 2 or 3, or "
                "drop it"
            )
        return self

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_is_an_int(cls, stage: Any) -> Any:
        # Literal[0, 1, 2, 3] alone would take YAML `true` as stage 1 and `3.0` as stage 3.
        if isinstance(stage, bool | float):
            raise ValueError(f"{stage!r} is not allowed; allowed values: 0, 1, 2, 3")
        return stage


TpStyle = Literal["colwise", "rowwise", "vocab"]


class TpLayer(Section):
    """How one layer (or every layer a glob matches) is split over the tensor-parallel ranks."""

    style: TpStyle = Field(
        description="colwise: a Linear's output features split (its input all-reduced in "
        "backward); rowwise: its input features split, its output all-reduced; vocab: an "
        "Embedding's or output head's vocabulary split (lookups all-reduced; logits gathered)"
    )
    fused: int = Field(
        1,
        ge=1,
        description="colwise: the output features are this many blocks side by side (q, k and "
        "v in one Linear: 3), each split alike, so every rank holds whole heads of each",
    )

    @model_validator(mode="after")
    def _fused_is_colwise(self) -> TpLayer:
        if self.fused > 1 and self.style != "colwise":
            raise ValueError(f"fused: {self.fused} splits blocks of output features: colwise only")
        return self


AUTO_UNITS = "auto"  # units.classes: the model's repeated block
AUTO_EXPERTS = "auto"  # parallel.experts: every class named *Experts


class ParallelConfig(Section):
    """The ranks' mesh beyond ZeRO: tensor parallelism over ``tp`` ranks (Megatron-style) and
    pipeline stages over ``pp``."""

    dp: int | None = Field(
        None, ge=1, description="data-parallel ranks (world size / (tp x pp)); checked when given"
    )
    pp: int = Field(
        1,
        ge=1,
        description="pipeline-parallel ranks: the model cut into consecutive stages at unit "
        "boundaries (the pipeline section says how); the ranks of one pipeline share a batch",
    )
    tp: int = Field(
        1, ge=1, description="tensor-parallel ranks: each layer of tp_layers is split over them"
    )
    tp_layers: dict[str, TpStyle | TpLayer] = Field(
        default_factory=dict,
        description="module FQN globs ('*' within a dotted name's component, '**' across "
        "dots, e.g. 'transformer.h.*.mlp.c_fc') -> style "
        "(colwise, rowwise, vocab) or {style, fused}; every glob must match a module",
    )

    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel ranks: each experts module's experts split over this many "
        "data-parallel ranks, its tokens sent to the ranks holding their experts and back "
        "(all-to-all); the experts' states sharded over the ranks holding the same experts",
    )
    experts: list[str] = Field(
        default_factory=lambda: [AUTO_EXPERTS],
        description="with ep > 1: the class names of the experts modules (their parameters "
        "stacked by expert along dim 0, called as (hidden_states, top_k_index, top_k_weights), "
        "as transformers' MoE models' are); 'auto': every class named *Experts",
    )

    sequence_parallel: bool = Field(
        False,
        description="between the tp layers (norms, dropout, residual adds) each tp rank holds "
        "its chunk of the sequence: rowwise outputs reduce-scattered and colwise inputs "
        "all-gathered along it (Megatron's sequence parallelism); activations there 1/tp",
    )
    sequence_dim: int = Field(
        -2,
        le=-1,
        description="the activations' sequence dimension, counted from the end: -2 for "
        "[batch, sequence, hidden], -3 for [sequence, batch, hidden]",
    )

    @model_validator(mode="after")
    def _sequence_is_split_by_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the sequence over the tp ranks: set tp > 1")
        return self

    @model_validator(mode="after")
    def _tp_names_layers(self) -> ParallelConfig:
        if self.tp > 1 and not self.tp_layers:
            raise ValueError(
                f"tp: {self.tp} splits the layers named in tp_layers, and it names none; e.g. "
                "tp_layers: {'*.attn.c_attn': {style: colwise, fused: 3}, '*.attn.c_proj': "
                "rowwise, '*.mlp.c_fc': colwise, '*.mlp.c_proj': rowwise}"
            )
        return self

    def layers(self) -> dict[str, TpLayer]:
        """``tp_layers`` with every style spelled out as a TpLayer."""
        return {
            glob: TpLayer(style=layer) if isinstance(layer, str) else layer
            for glob, layer in self.tp_layers.items()
        }


class UnitsConfig(Section):
    """How parameters are grouped into FSDP units (gathered, freed and reduced together)."""

    classes: list[str] = Field(
        default_factory=list,
        description="every module whose class name is listed becomes one FSDP unit, "
        "innermost first; 'auto': the model's repeated block (a transformer's layer), what a "
        "stage-3 plan that names no units gets (`units: auto` is short for [auto])",
    )
    modules: list[str] = Field(
        default_factory=list,
        description="globs over module FQNs, e.g. 'transformer.h.*' (every block) or "
        "'transformer.h.[0-3]'; '*' stops at dots, '**' crosses them",
    )
    min_mb: float | None = Field(
        None,
        gt=0,
        le=MAX_MB,
        description="size-based wrapping: a module whose not-yet-assigned parameters reach this "
        "many MB becomes a unit, bottom-up",
    )
    blocks_per_unit: int = Field(
        1,
        ge=1,
        le=1024,
        description="the units of one class under one parent (a transformer's blocks) grouped "
        "this many to a unit, in model order ('transformer.h.0-1'): one gather, free and "
        "reduction for k blocks, k gathered at once; not with parallel.pp",
    )
    keep_gathered: list[str] = Field(
        default_factory=list,
        description="stage 3: globs over unit names ('root' is the root unit; '*' stops at "
        "dots, '**' crosses them) of units "
        "gathered once per step and kept until their last use in backward (no re-gather in "
        "backward), like FSDP2's reshard_after_forward=False",
    )
    keep_gathered_below_mb: float | None = Field(
        None,
        gt=0,
        description="stage 3: units whose gathered parameters are smaller than this many MB are "
        "kept gathered for the step too (DeepSpeed's persistence threshold, per step)",
    )


def check_layout(
    world_size: int,
    replicate: int = 1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    secondary: int = 1,
) -> None:
    """A PlanError when ``world_size`` ranks cannot be split into ``parallel.pp`` pipeline
    stages' ranks of ``zero.replicate`` replicas of shard groups, each rank of them
    ``parallel.tp`` tensor-parallel ranks, their data-parallel ranks in groups of
    ``parallel.ep`` splitting the experts, and each shard group in groups of
    ``zero.secondary_group``."""
    if world_size % tp:
        raise PlanError(
            f"parallel.tp: {tp} does not divide the world size {world_size}; allowed: a "
            f"divisor of {world_size}"
        )
    if world_size % (tp * pp):
        raise PlanError(
            f"parallel.pp: {pp} does not divide the {world_size // tp} ranks"
            f"{_of_tp(world_size, tp)}; allowed: a divisor of {world_size // tp}"
        )
    world_size //= pp  # the ranks of one pipeline stage
    data = world_size // tp
    if replicate > 1 and data % replicate:
        ranks = "world size" if tp == 1 else "data-parallel ranks"
        raise PlanError(
            f"zero.replicate: {replicate} does not divide the {ranks} {data}"
            f"{_of_tp(world_size, tp)}; allowed: a divisor of {data}"
        )
    if replicate > 1 and data == replicate:
        raise PlanError(
            f"zero.replicate: {replicate} leaves shard groups of one rank ({data} "
            f"data-parallel ranks{_of_tp(world_size, tp)}): nothing would be sharded; use "
            "zero.stage: 0 (DDP) for full replicas, or a smaller replicate (a divisor of "
            f"{data} below it)"
        )
    if ep > 1 and data % ep:
        raise PlanError(
            f"parallel.ep: {ep} does not divide the {data} data-parallel ranks"
            f"{_of_tp(world_size, tp)}; allowed: a divisor of {data}"
        )
    shard = data // replicate
    if secondary > 1 and (shard % secondary or secondary == shard):
        allowed = [g for g in range(2, shard) if shard % g == 0]
        raise PlanError(
            f"zero.secondary_group: {secondary} must divide the shard group of {shard} ranks and "
            f"be smaller (at {shard} backward would gather over the same ranks as forward); "
            f"allowed: {', '.join(map(str, allowed)) or 'none: the shard group is too small'}"
        )
    if secondary > 1 and pp > 1:
        raise PlanError(
            f"zero.secondary_group: {secondary} with parallel.pp: {pp}: a pipeline stage's "
            "forward and backward are separate programs per micro-batch, and the secondary "
            "copy is not carried between them yet; drop one of the two"
        )


def _of_tp(world_size: int, tp: int) -> str:
    return f" ({world_size} ranks / parallel.tp {tp})" if tp > 1 else ""
