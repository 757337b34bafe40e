"""The plan's features as factors and levels, their pairs, and the rows of a pairwise covering
array over them (tests/sweep/test_feature_pairs.py).

A factor is one feature of the plan (``tp``, ``pp``, ``precision``, ...) and its levels the ways
it is turned on, each as plan fields and as the keys of a parity case (tests/parity/__init__.py);
a factor off leaves its fields at their defaults. ``stage`` and ``model`` have no "off": every
row names one of each. A *pair* is two levels of two factors. Each pair is first checked by plan
check alone (cheap): refused, its PlanError must name a field of each; accepted, it must be
covered by a trained *row*. The rows come from a small deterministic greedy (in the manner of
AETG): each row starts from the first pair no row covers yet and adds, factor by factor, the
level that covers the most uncovered pairs, where every pair it makes is accepted, the row's
plan passes plan check and its layout stays within 4 ranks (8 where its first pair needs it).
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import models
from models import MOE_MODELS, PIPELINE_MODELS, CausalLM, _token_batch, build, entry
from parity import case_id, plan_of

from zerocc.cli.plan import checked_model
from zerocc.compiler.plan import load_plan
from zerocc.compiler.workload import Workload
from zerocc.errors import PlanError

STEPS = 2  # optimizer steps of each row
MAX_FEATURES = 5  # levels of a row beside its stage and model
MAX_WORLD = 4  # ranks of a row, unless its first pair takes more


def _llama_4_layers() -> CausalLM:
    """The tiny Llama with 4 decoder layers: a pipeline of 2 ranks cuts 4 stages of it."""
    model = CausalLM()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**model.lm.config.to_dict(), "num_hidden_layers": 4})
    model.lm = LlamaForCausalLM(config)
    return model


# A pipeline's models: 4 layers, so that interleaved and zero-bubble schedules cut 4 stages.
# Registered beside tests/models.py's (the ranks import this module before they build one).
PIPELINE_MODELS.setdefault(
    "llama4", (_llama_4_layers, _token_batch, {"classes": ["LlamaDecoderLayer"]})
)
models.TP_LAYERS.setdefault("llama4", models.LLAMA_TP_LAYERS)
models.TP_LAYERS.setdefault("mixtral4_grouped", models.MIXTRAL_TP_LAYERS)
assert "mixtral4_grouped" in MOE_MODELS

# model level -> (the model's name in tests/models.py; in a pipeline row)
MODELS = {"gpt": ("gpt", "gpt4"), "llama": ("llama", "llama4"),
          "mixtral": ("mixtral", "mixtral4_grouped")}  # fmt: skip


@dataclass(frozen=True)
class Level:
    """One way a factor is turned on: the parity case's keys it sets (``case``), the plan
    fields beyond what the harness writes (``fields``, dotted paths), and the plan fields that
    name it in a PlanError (``names``)."""

    factor: str
    name: str
    case: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    fields: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.factor}={self.name}"


def _levels() -> list[Level]:
    L = Level
    return [
        *(L("stage", str(s), {"stage": s}, names=("zero.stage",)) for s in range(4)),
        *(L("model", m, names=("model", "workload")) for m in MODELS),
        L("hsdp", "replicate2", {"replicate": 2}, names=("zero.replicate",)),
        L("tp", "2", {"tp": 2}, names=("parallel.tp",)),
        # (sequence parallelism is tp's: a refusal of tp names it; an ep row's model is the
        # Mixtral, the one with experts: a refusal of that model names the model)
        L("sp", "on", {"tp": 2, "sp": True}, names=("parallel.sequence_parallel", "parallel.tp")),
        *(
            L("pp", s, {"pp": 2, "schedule": s, "accum": 2}, names=("parallel.pp", "pipeline"))
            for s in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
        ),  # fmt: skip
        L("ep", "2", {"ep": 2}, names=("parallel.ep", "parallel.experts", "model")),
        L("recompute", "all", {"recompute": {"units": "all"}}, names=("recompute",)),
        L("offload", "optimizer", {"offload": {"optimizer": "cpu"}}, names=("offload",)),
        L("precision", "bf16", {"precision": {"param": "bf16"}}, names=("precision",)),
        L(
            "precision",
            "fp16",
            {"precision": {"param": "fp16", "dynamic": {"hysteresis": 1}}},
            names=("precision",),
        ),  # fmt: skip
        L("fp8", "matmul", fields={"precision.matmul": "fp8"}, names=("precision.matmul",)),
        L(
            "quantized",
            "weights_int8",
            fields={"zero.quantized_weights": "int8"},
            names=("zero.quantized_weights",),
        ),  # fmt: skip
        L(
            "quantized",
            "grads_int8",
            fields={"zero.quantized_grads": "int8"},
            names=("zero.quantized_grads",),
        ),  # fmt: skip
        L("secondary", "2", {"secondary": 2}, names=("zero.secondary_group",)),
        L("keyed", "on", {"keyed": True}, names=("capture.draws",)),
        L(
            "accum",
            "2",
            {"accum": 2},
            fields={"grad_accumulation": 2},
            names=("grad_accumulation",),
        ),  # fmt: skip
        L("inductor", "on", {"backend": "inductor"}, names=("backend.name",)),
        L(
            "async_save",
            "on",
            fields={"checkpoint.async_save": True},
            names=("checkpoint.async_save",),
        ),  # fmt: skip
        L(
            "in_memory",
            "on",
            fields={"checkpoint.in_memory": True},
            names=("checkpoint.in_memory",),
        ),  # fmt: skip
        L("eval", "on", fields={"metrics.eval_every": 1}, names=("metrics.eval_every",)),
    ]


LEVELS = _levels()
FACTORS = list(dict.fromkeys(level.factor for level in LEVELS))
ALWAYS_SET = ("stage", "model")  # factors with no "off": every row names a level of each
BASE = {"stage": "3", "model": "gpt"}  # their levels in a pair that names neither


def level(text: str) -> Level:
    """The level ``factor=name``."""
    return next(lv for lv in LEVELS if str(lv) == text)


Pair = tuple[Level, Level]


def pairs() -> list[Pair]:
    """Every pair of levels of two factors, in a fixed order."""
    return [(a, b) for a, b in itertools.combinations(LEVELS, 2) if a.factor != b.factor]


@dataclass(frozen=True)
class Row:
    """A cell's levels, one per factor it turns on (stage and model always)."""

    levels: tuple[Level, ...]

    def __str__(self) -> str:
        return ",".join(map(str, self.levels))

    def of(self, factor: str) -> Level | None:
        return next((lv for lv in self.levels if lv.factor == factor), None)

    def factors(self) -> set[str]:
        return {lv.factor for lv in self.levels}

    def covers(self) -> set[tuple[str, str]]:
        return {_key(a, b) for a, b in itertools.combinations(self.levels, 2)}


def _key(a: Level, b: Level) -> tuple[str, str]:
    return tuple(sorted((str(a), str(b))))  # type: ignore[return-value]


def row_of(levels: Iterable[Level]) -> Row:
    """The row of ``levels``, the base stage and model added where they name none, in the
    factors' order."""
    chosen = {lv.factor: lv for lv in levels}
    if "ep" in chosen:  # (experts: the mixture of experts' model)
        chosen.setdefault("model", level("model=mixtral"))
    for factor, name in BASE.items():
        chosen.setdefault(factor, level(f"{factor}={name}"))
    return Row(tuple(chosen[f] for f in FACTORS if f in chosen))


def case_of(row: Row) -> dict[str, Any]:
    """The parity case of ``row`` (tests/parity/__init__.py's keys) and its extra plan fields
    (``fields``)."""
    case: dict[str, Any] = {"steps": STEPS, "fields": {}}
    for lv in row.levels:
        case |= copy.deepcopy(lv.case)
        case["fields"] |= lv.fields
    pipeline = "pp" in case
    case["model"] = MODELS[row.of("model").name][pipeline]
    data = 2 * case.get("replicate", 1) * case.get("secondary", 1)
    case["world"] = data * case.get("tp", 1) * case.get("pp", 1)
    if not pipeline:
        case["fields"].pop("grad_accumulation", None)  # (the harness's accum writes it)
    if row.of("ep") is not None:
        case["fields"]["parallel.experts"] = ["MixtralExperts"]
    case["id"] = str(row)
    return case


def plan_dict(case: dict[str, Any], folder: str | None = None) -> dict[str, Any]:
    """The plan of ``case``: the harness's (:func:`parity.plan_of`) with its extra fields
    (checkpoints in ``folder``)."""
    plan = plan_of({k: v for k, v in case.items() if k != "fields"})
    for path, value in case["fields"].items():
        *sections, name = path.split(".")
        node = plan
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    if case["fields"].get("checkpoint.in_memory") or case["fields"].get("checkpoint.async_save"):
        plan["checkpoint"]["dir"] = folder or "checkpoints"
    return plan


@functools.cache
def _workload(model: str) -> Workload:
    """tests/models.py's ``model`` and its batches as a workload (built once: plan check only
    reads it)."""
    batch = entry(model)[1]
    return Workload(build(model), batches=lambda rank, world: (batch(i, rank) for i in range(9)))


@functools.cache
def refusal(row: Row) -> PlanError | None:
    """Plan check on ``row``'s plan (``zerocc plan check``: its fields, layout and the model's
    names: :func:`zerocc.cli.plan.checked_model` on the row's model): its PlanError, or None."""
    case = case_of(row)
    try:
        plan = load_plan(plan_dict(case))
        plan.check_world_size(case["world"])
        with mock.patch(
            "zerocc.compiler.workload.load_workload", lambda _: _workload(case["model"])
        ):
            checked_model(plan)
    except PlanError as exc:
        return exc
    return None


@functools.cache
def pair_refusals() -> dict[tuple[str, str], str | None]:
    """Each pair's refusal by plan check (its message), or None."""
    out = {}
    for a, b in pairs():
        exc = refusal(row_of((a, b)))
        out[_key(a, b)] = str(exc) if exc is not None else None
    return out


def _fits(row: Row, limit: int) -> bool:
    return case_of(row)["world"] <= limit and len(row.levels) - len(ALWAYS_SET) <= MAX_FEATURES


@functools.cache
def covering_rows() -> tuple[Row, ...]:
    """Rows that cover every accepted pair, by the greedy of the module's docstring."""
    refused = pair_refusals()
    return _greedy([k for k, why in refused.items() if why is None], ())


def repair_rows(failing: tuple[Row, ...], avoid: tuple[frozenset[str], ...]) -> tuple[Row, ...]:
    """More rows, for the accepted pairs only ``failing`` rows cover: by the same greedy,
    none holding every level of a set of ``avoid`` (``pp=*``: any level of pp), where rows
    are known to fail."""
    passing = [row for row in covering_rows() if row not in failing]
    covered = set().union(*(row.covers() for row in passing))
    orphans = [k for k, why in pair_refusals().items() if why is None and k not in covered]
    return _greedy(orphans, avoid)


def _avoided(row: Row, avoid: tuple[frozenset[str], ...]) -> bool:
    names = {str(lv) for lv in row.levels} | {f"{lv.factor}=*" for lv in row.levels}
    return any(combination <= names for combination in avoid)


def _greedy(targets: list[tuple[str, str]], avoid: tuple[frozenset[str], ...]) -> tuple[Row, ...]:
    refused = pair_refusals()
    left = set(targets)
    rows = []
    while left:
        first = next(k for k in targets if k in left)
        row = row_of(map(level, first))
        left.discard(first)
        if _avoided(row, avoid):  # (the pair itself fails: its failing row says so)
            continue
        fixed = {level(text).factor for text in first}
        limit = max(MAX_WORLD, case_of(row)["world"])
        while True:  # the level that covers the most uncovered pairs, until none adds any
            trials = []
            for candidate in LEVELS:
                if candidate.factor in fixed:
                    continue
                others = [lv for lv in row.levels if lv.factor != candidate.factor]
                trial = row_of([*others, candidate])
                gain = len(trial.covers() & left) - len(row.covers() & left)
                if gain > 0 and not any(refused.get(_key(candidate, lv)) for lv in others):
                    trials.append((-gain, str(candidate), trial, candidate))
            for _, _, trial, candidate in sorted(trials, key=lambda t: t[:2]):
                if _fits(trial, limit) and not _avoided(trial, avoid) and refusal(trial) is None:
                    row = trial
                    fixed.add(candidate.factor)
                    break
            else:
                break
        left -= row.covers()
        rows.append(row)
    return tuple(rows)


def case_key(case: dict[str, Any]) -> str:
    """The harness's id of ``case``'s training results."""
    return case_id(case)
