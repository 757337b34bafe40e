"""The systems bench/compare.py trains, one runner each: zerocc, PyTorch FSDP2, DeepSpeed ZeRO.

A runner takes the freshly built example GPT on the CPU (the same weights in every system) and
returns a :class:`Runner` whose ``train_step(idx, targets)`` does one optimizer step of this
rank's batch, DDP semantics (gradients averaged over ranks), AdamW with the benchmark's
hyperparameters, no clipping. Each runs inside a rank process whose process group is already
initialized (gloo on CPU, NCCL on CUDA); libraries are imported there, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from config import DTYPES, BenchConfig
from torch import nn


@dataclass
class Runner:
    """One system set up on one rank."""

    train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # returns the loss
    # The same step, measured op by op: returns (loss, peak bytes of live tensors).
    profile_step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]] | None = None
    reported: Callable[[], dict[str, Any]] = dict  # what the system says of its last step


@dataclass(frozen=True)
class System:
    """A named way to train: its family, ZeRO stage, runner and what it runs."""

    name: str
    family: str  # zerocc | fsdp2 | deepspeed
    stage: int
    build: Callable[[nn.Module, BenchConfig, torch.device], Runner] = field(repr=False)
    what: str  # one line for the table's legend
    imports: tuple[str, ...] = ()  # imported before the model is built: not counted as memory


def _adamw(params: Any, cfg: BenchConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def zerocc_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *, stage: int,
                  backend: str = "eager", overlap: dict | None = None) -> Runner:  # fmt: skip
    """``zerocc.compile`` with one unit per Block (the embeddings, final LN and head: the root);
    ``overlap``: the plan's overlap section (default: the overlap pass with its defaults)."""
    import zerocc

    plan: dict[str, Any] = {
        "zero": {"stage": stage, "world_size": cfg.world_size},
        "units": {"classes": ["Block"]},
        "optimizer": {
            "name": "adamw",
            "lr": cfg.lr,
            "betas": list(cfg.betas),
            "eps": cfg.eps,
            "weight_decay": cfg.weight_decay,
        },
        "backend": {"name": backend, "device": device.type},
        "overlap": overlap or {},
        "seed": cfg.seed,
    }
    if cfg.dtype != "fp32":
        plan["precision"] = {"param": cfg.dtype, "reduce": "fp32", "master": "fp32"}
    step = zerocc.compile(model, plan)

    def profile_step(idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        loss, recorder = step.profile(idx, targets)
        return loss, recorder.timeline.peak()[1]

    def reported() -> dict[str, Any]:
        summary = step.summary()
        return {
            "comm_bytes": summary["comm_bytes_per_step"],
            "model_state_bytes": summary["model_state_bytes"],
        }

    return Runner(step, profile_step, reported)


def fsdp2_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *,
                 reshard_after_forward: bool, compiled: bool) -> Runner:  # fmt: skip
    """``fully_shard`` on every Block, then on the root; optionally ``torch.compile(model)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(device)
    mesh = init_device_mesh(device.type, (cfg.world_size,))
    mp_policy = MixedPrecisionPolicy()
    if cfg.dtype != "fp32":
        mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dtype], reduce_dtype=torch.float32)
    shard = partial(
        fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
    )
    for block in model.transformer.h:
        shard(block)
    shard(model)
    optimizer = _adamw(model.parameters(), cfg)
    forward = torch.compile(model) if compiled else model

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = forward(idx.to(device), targets.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner(train_step)


def deepspeed_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *,
                     stage: int) -> Runner:  # fmt: skip
    """``deepspeed.initialize`` with ZeRO ``stage`` and torch's AdamW as the client optimizer."""
    import deepspeed

    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, the optimizer every system runs
        "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 unless told; no system clips here
        "steps_per_print": 1 << 30,
    }
    if cfg.dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_adamw(model.parameters(), cfg), config=ds_config
    )

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(idx.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return Runner(train_step)


def _zerocc_backends() -> list[str]:
    from zerocc.backends import BACKENDS

    return list(BACKENDS)


def all_systems() -> dict[str, System]:
    """Every system by name: zerocc stages 1-3 on each of its backends, FSDP2 ZeRO-3/ZeRO-2
    eager and compiled, DeepSpeed ZeRO 1-3."""
    systems: list[System] = []
    for backend in _zerocc_backends():
        suffix = "" if backend == "eager" else f"-{backend}"
        for stage in (1, 2, 3):
            systems.append(System(
                f"zerocc-z{stage}{suffix}", "zerocc", stage,
                partial(zerocc_runner, stage=stage, backend=backend),
                f"zerocc.compile, zero.stage {stage}, backend {backend}", ("zerocc",),
            ))  # fmt: skip
    for compiled in (False, True):
        for stage, reshard in ((3, True), (2, False)):
            systems.append(System(
                f"fsdp2-z{stage}{'-compiled' if compiled else ''}", "fsdp2", stage,
                partial(fsdp2_runner, reshard_after_forward=reshard, compiled=compiled),
                f"fully_shard(reshard_after_forward={reshard})"
                + (", torch.compile(model)" if compiled else ", eager"),
                ("torch.distributed.fsdp",) + (("torch._inductor.compile_fx",) if compiled else ()),
            ))  # fmt: skip
    for stage in (1, 2, 3):
        systems.append(System(
            f"deepspeed-z{stage}", "deepspeed", stage, partial(deepspeed_runner, stage=stage),
            f"deepspeed.initialize, zero_optimization.stage {stage}, torch AdamW",
            ("deepspeed",),
        ))  # fmt: skip
    return {s.name: s for s in systems}
