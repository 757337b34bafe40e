"""A captured GPT step and its stages, run on real tensors: what the stage-cut, pipeline and
stage-balance tests share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from models import GPT, GPTConfig, _gpt_batch
from torch import fx, nn

from zerocc.compiler.capture import Casts, ModelInfo, capture, describe_model
from zerocc.compiler.parallel.pipeline_schedule import PipelineSchedule, pipeline_schedule
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import Slot, StagedStep
from zerocc.ir.kinds import Role
from zerocc.runtime.pipeline import run_in_one_process

# (schedule, pp, stages_per_rank): one of each schedule, each as the tests walk it
SCHEDULE_CASES = [
    ("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 2, 2), ("zero-bubble", 2, 2)
]  # fmt: skip

CPU = torch.device("cpu")


def captured(model: nn.Module, batch: tuple, casts: Casts | None = None):
    """``model``'s step captured on ``batch`` (fake tensors), and the model described."""
    info = describe_model(model)
    return capture(model, info, None, batch, CPU, casts), info


def whole(gm, info: ModelInfo, model: nn.Module, batch: tuple):
    """Loss and gradients (by FQN) of the captured step run whole on the model's weights."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    args = [params[p.fqn].detach() for p in info.params] + [buffers[b.fqn] for b in info.buffers]
    loss, *grads = gm(*args, *batch)
    return loss, {p.fqn: g for p, g in zip(info.trainable, grads, strict=True) if g is not None}


def gpt(n_layer: int = 4) -> GPT:
    """The tiny GPT with ``n_layer`` blocks, seeded."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16))


def blocks(n: int, stages: int) -> list[list[str]]:
    """``n`` GPT blocks split evenly into ``stages`` stages."""
    per = n // stages
    return [[f"transformer.h.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]


def model_inputs(model: nn.Module, microbatches: list[tuple]):
    """What a captured stage program's slots bind: the model's parameters and buffers, and
    each micro-batch's tensors."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def inputs(slot: Slot, microbatch: int) -> torch.Tensor:
        if slot.kind == Role.PARAM:
            return params[slot.key]
        if slot.kind == Role.BUFFER:
            return buffers[slot.key]
        assert slot.kind == Role.BATCH, slot
        return microbatches[microbatch][int(slot.key)]

    return inputs


@dataclass
class Walked:
    """A 4-block GPT's step captured, cut for a schedule, and every rank of it walked in one
    process over ``microbatches``."""

    model: nn.Module
    microbatches: list[tuple]
    gm: fx.GraphModule
    info: ModelInfo
    staged: StagedStep
    schedule: PipelineSchedule
    ranks: list[Any]  # CapturedRank, by pipeline rank


def walked(name: str, pp: int, stages_per_rank: int, microbatches: int = 4) -> Walked:
    """The tiny GPT's step cut into ``pp × stages_per_rank`` stages and walked by schedule
    ``name`` over ``microbatches`` micro-batches, every rank in this process."""
    model = gpt(4)
    batches = [_gpt_batch(m, 0) for m in range(microbatches)]
    gm, info = captured(model, batches[0])
    staged = cut_stages(gm, info, blocks(4, pp * stages_per_rank))
    schedule = pipeline_schedule(name, pp, microbatches, stages_per_rank)
    ranks = run_in_one_process(staged, info, schedule, model_inputs(model, batches))
    return Walked(model, batches, gm, info, staged, schedule, ranks)
