"""The systems the benchmarks train, one runner each: zerocc, PyTorch FSDP2, DeepSpeed ZeRO.

A runner takes the freshly built model (bench/config.py) on the CPU (the same weights in every
system) and returns a :class:`Runner` whose ``train_step(idx, targets)`` does one optimizer step
of this rank's batch, DDP semantics (gradients averaged over ranks), AdamW with the benchmark's
hyperparameters, no clipping. Each runs inside a rank process whose process group is already
initialized (gloo on CPU, NCCL on CUDA); libraries are imported there, not here.

:func:`all_systems` holds bench/compare.py's systems; :func:`offload_systems` the memory-saving
variants bench/offload.py adds (offload, recomputation). A rank finds either kind by name in
``all_systems()``, which iterates over compare.py's alone.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from config import DTYPES, BenchConfig, layer_class, layers
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
    compiled: bool = False  # its compute compiled by Inductor, which rounds otherwise than eager
    float8: bool = False  # its matmuls in float8: a loss of its own (compare.py's FLOAT8_RTOL)


def cpu_seconds() -> dict[str, Any]:
    """The CPU time this rank process has used so far, all its threads (gloo's, the NVMe I/O
    threads): between two answers, the work of the steps in between, however busy the machine."""
    return {"cpu_s": time.process_time()}


def _adamw(params: Any, cfg: BenchConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def zerocc_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *, stage: int,
                  backend: str = "eager", overlap: dict | None = None, offload: dict | None = None,
                  recompute: dict | None = None, expert_parallel: bool = False,
                  float8: str | None = None) -> Runner:  # fmt: skip
    """``zerocc.compile`` with one unit per layer (the GPT's Blocks; the embeddings, final LN
    and head: the root);
    ``overlap``, ``offload``, ``recompute``: those sections of the plan (default: the overlap
    pass with its defaults, nothing offloaded, nothing recomputed). NVMe offload without an
    ``nvme_path`` puts its files under ``cfg.nvme_path``, else the system's temp folder.
    ``expert_parallel``: each layer's experts split over every rank (``parallel.ep``);
    ``float8``: ``precision.matmul: fp8`` with this recipe (its default layers: every linear
    layer but the head)."""
    import zerocc

    plan: dict[str, Any] = {
        "zero": {"stage": stage, "world_size": cfg.world_size},
        "units": {"classes": [layer_class(cfg)]},
        "optimizer": {
            "name": "adamw",
            "lr": cfg.lr,
            "betas": list(cfg.betas),
            "eps": cfg.eps,
            "weight_decay": cfg.weight_decay,
        },
        "backend": {"name": backend, "device": device.type},
        "overlap": overlap or {},
        "offload": dict(offload or {}),
        "recompute": recompute or {},
        "seed": cfg.seed,
    }
    if expert_parallel:
        plan["parallel"] = {"ep": cfg.world_size}
    if "nvme" in plan["offload"].values() and not plan["offload"].get("nvme_path"):
        plan["offload"]["nvme_path"] = cfg.nvme_path or tempfile.gettempdir()
    if cfg.dtype != "fp32":
        plan["precision"] = {"param": cfg.dtype, "reduce": "fp32", "master": "fp32"}
    if float8 is not None:
        plan["precision"] = plan.get("precision", {}) | {"matmul": "fp8",
                                                         "fp8": {"recipe": float8}}  # fmt: skip
    step = zerocc.compile(model, plan)
    host_rates: dict[str, dict[str, float]] = {}  # measured at the first report (offload, GPU)

    def profile_step(idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        # on the eager binding: a compiled region is one call, the values it holds unseen
        loss, recorder = step.profile(idx, targets, backend=None if backend == "eager" else "eager")
        return loss, recorder.timeline.peak()[1]

    def reported() -> dict[str, Any]:
        from zerocc.cost.rates import rates_for
        from zerocc.cost.simulate import predict_step
        from zerocc.inspect.explain import transfer_bytes_per_step

        summary, record = step.summary(), step.record()
        rates = rates_for(record.plan, record.device_type)
        calibrated = "calibration" in rates.sources.values()

        def predicted_s(rates: Any) -> float:
            return predict_step(record.programs, record.plan.grad_accumulation, rates,
                                record.world_size, mesh=record.mesh).step_s  # fmt: skip

        offloaded = record.plan.offload.optimizer != "none"
        host_rated = {}
        if offloaded and not calibrated and record.device_type == "cuda":
            # Measured once, at the warm-up's report, before its CPU time is read: the
            # rounds' CPU time per step (differences of these reports) does not hold it.
            host_rates.setdefault("rates", _host_rates(device))
            host_rated = {
                "predicted_step_s_host_rates": predicted_s(
                    rates.replace("calibration", **host_rates["rates"])
                ),
                "host_rates": host_rates["rates"],
            }
        return (
            {
                "comm_bytes": summary["comm_bytes_per_step"],
                "model_state_bytes": summary["model_state_bytes"],  # the device pool's
                "state_bytes_by_location": step.state.bytes_by_location(),  # device, host, nvme
                "transfer_bytes": summary["offload_bytes_per_step"],  # offload's copies, last step
                "transfer_bytes_program": transfer_bytes_per_step(record),  # what the program says
                # zerocc estimate's simulation of the step (plan rates, a calibration or defaults)
                "predicted_step_s": predicted_s(rates),
                "predicted_rates": "calibrated" if calibrated else "default",
                "setup_seconds": summary["setup_seconds"],  # by phase (explain()'s setup line)
                "backend_notes": record.backend_notes,  # how it lowered: whole, regions, eager
            }
            | host_rated
            | cpu_seconds()
        )

    return Runner(step, profile_step, reported)


def _host_rates(device: torch.device) -> dict[str, float]:
    """The host's update and link rates, measured here as `zerocc profile` measures them for
    an offloaded plan on a GPU: an offloaded step predicted with them (the other rates
    default) says whether the model of the host's work holds (issue 22: within 25%)."""
    from zerocc.inspect.host_rates import host_link_rate, host_update_rate

    return {
        "host_memory_bytes_per_s": host_update_rate()["bytes_per_s"],
        "host_link_bytes_per_s": host_link_rate(device),
    }


def fsdp2_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *,
                 reshard_after_forward: bool, compiled: bool,
                 cpu_offload: dict | None = None) -> Runner:  # fmt: skip
    """``fully_shard`` on every layer (the GPT's Blocks), then on the root; optionally
    ``torch.compile(model)``; ``cpu_offload``: ``offload_policy=CPUOffloadPolicy(**cpu_offload)``
    (None: no offload)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    model.to(device)
    mesh = init_device_mesh(device.type, (cfg.world_size,))
    mp_policy = MixedPrecisionPolicy()
    if cfg.dtype != "fp32":
        mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dtype], reduce_dtype=torch.float32)
    offload = OffloadPolicy() if cpu_offload is None else CPUOffloadPolicy(**cpu_offload)
    shard = partial(
        fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_policy=offload,
    )  # fmt: skip
    for block in layers(model):
        shard(block)
    shard(model)
    optimizer = _adamw(model.parameters(), cfg)
    forward = torch.compile(model) if compiled else model
    return Runner(_train_step(forward, optimizer, device), reported=cpu_seconds)


def _train_step(forward, optimizer, device: torch.device, autocast=None):
    """A plain torch training step: forward (under ``autocast``), backward, update."""
    autocast = autocast or contextlib.nullcontext()

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast:
            loss = forward(idx.to(device), targets.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


def torch_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *,
                 compiled: bool, float8: str | None = None) -> Runner:  # fmt: skip
    """Unsharded: the whole model on every rank (``DistributedDataParallel`` beyond one rank),
    optionally ``torch.compile``; below fp32, ``torch.autocast`` to the compute dtype with fp32
    weights and optimizer: what a user gets without sharding, the speed a sharded step at world
    size 1 is held to. ``float8``: torchao's float8 training of that recipe first
    (``convert_to_float8_training``), on the layers zerocc's fp8 plans convert by default."""
    from torch.nn.parallel import DistributedDataParallel

    if float8 is not None:
        _torchao_float8(model, float8)
    model.to(device)
    wrapped = model if cfg.world_size == 1 else DistributedDataParallel(model)
    optimizer = _adamw(model.parameters(), cfg)
    forward = torch.compile(wrapped) if compiled else wrapped
    autocast = torch.autocast(device.type, DTYPES[cfg.dtype], enabled=cfg.dtype != "fp32")
    return Runner(_train_step(forward, optimizer, device, autocast), reported=cpu_seconds)


def _torchao_float8(model: nn.Module, recipe: str) -> None:
    """torchao's float8 layers in ``model`` as its README converts them, on every linear layer
    whose dimensions are multiples of 16 but the last (the output head)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]

    def chosen(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn == linears[-1]:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=chosen)


def deepspeed_runner(model: nn.Module, cfg: BenchConfig, device: torch.device, *,
                     stage: int, offload_optimizer: str | None = None,
                     offload_param: str | None = None) -> Runner:  # fmt: skip
    """``deepspeed.initialize`` with ZeRO ``stage`` and torch's AdamW as the client optimizer;
    ``offload_optimizer`` / ``offload_param``: the ``device`` of those ZeRO sections (None: off).
    Offloaded, the client AdamW stays (``zero_force_ds_cpu_optimizer: false``): DeepSpeed's own
    DeepSpeedCPUAdam would round otherwise than every other system's optimizer."""
    import deepspeed

    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer}
    if offload_param:
        zero["offload_param"] = {"device": offload_param}
    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, the optimizer every system runs
        "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 unless told; no system clips here
        "steps_per_print": 1 << 30,
    }
    if offload_optimizer:
        ds_config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW stays, offloaded too
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

    return Runner(train_step, reported=cpu_seconds)


def _zerocc_backends() -> list[str]:
    from zerocc.backends import BACKENDS

    return list(BACKENDS)


class Systems(dict[str, System]):
    """Systems by name, in bench/compare.py's order; a name not among them is looked up in
    :func:`offload_systems`, :func:`expert_systems` and :func:`float8_systems`, so that a rank
    process builds any benchmark's system by name."""

    def __missing__(self, name: str) -> System:
        more = offload_systems() | expert_systems() | float8_systems()
        if name not in more:
            raise KeyError(name)
        return more[name]


def all_systems() -> Systems:
    """Every system bench/compare.py runs, by name: zerocc stages 1-3 on each of its backends,
    FSDP2 ZeRO-3/ZeRO-2 eager and compiled, DeepSpeed ZeRO 1-3, unsharded torch eager and
    compiled."""
    systems: list[System] = []
    for backend in _zerocc_backends():
        suffix = "" if backend == "eager" else f"-{backend}"
        for stage in (1, 2, 3):
            systems.append(System(
                f"zerocc-z{stage}{suffix}", "zerocc", stage,
                partial(zerocc_runner, stage=stage, backend=backend),
                f"zerocc.compile, zero.stage {stage}, backend {backend}", ("zerocc",),
                compiled=backend != "eager",
            ))  # fmt: skip
    for compiled in (False, True):
        for stage, reshard in ((3, True), (2, False)):
            systems.append(System(
                f"fsdp2-z{stage}{'-compiled' if compiled else ''}", "fsdp2", stage,
                partial(fsdp2_runner, reshard_after_forward=reshard, compiled=compiled),
                f"fully_shard(reshard_after_forward={reshard})"
                + (", torch.compile(model)" if compiled else ", eager"),
                ("torch.distributed.fsdp",) + (("torch._inductor.compile_fx",) if compiled else ()),
                compiled,
            ))  # fmt: skip
    for stage in (1, 2, 3):
        systems.append(System(
            f"deepspeed-z{stage}", "deepspeed", stage, partial(deepspeed_runner, stage=stage),
            f"deepspeed.initialize, zero_optimization.stage {stage}, torch AdamW",
            ("deepspeed",),
        ))  # fmt: skip
    for compiled in (False, True):
        systems.append(System(
            f"torch{'-compiled' if compiled else ''}", "torch", 0,
            partial(torch_runner, compiled=compiled),
            "unsharded (DDP beyond one rank), autocast below fp32"
            + (", torch.compile(model)" if compiled else ", eager"),
            ("torch._inductor.compile_fx",) if compiled else (), compiled,
        ))  # fmt: skip
    return Systems((s.name, s) for s in systems)


# zerocc stage 3 with each memory-saving option: (name suffix, offload, recompute, what).
ZEROCC_SAVINGS = (
    ("opt-cpu", {"optimizer": "cpu"}, None, "offload.optimizer: cpu"),
    ("opt-cpu-r0.5", {"optimizer": "cpu", "ratio": 0.5}, None,
     "offload.optimizer: cpu, offload.ratio: 0.5"),
    ("opt-nvme", {"optimizer": "nvme"}, None, "offload.optimizer: nvme (files in a temp folder)"),
    ("opt-par-cpu", {"optimizer": "cpu", "params": "cpu"}, None,
     "offload.optimizer: cpu, offload.params: cpu"),
    ("recompute", None, {"units": "all"}, "recompute.units: all"),
    ("opt-par-cpu-rc", {"optimizer": "cpu", "params": "cpu"}, {"units": "all"},
     "offload.optimizer: cpu, offload.params: cpu, recompute.units: all"),
    ("opt-cpu-next", {"optimizer": "cpu", "defer_updates": "next_forward"}, None,
     "offload.optimizer: cpu, offload.defer_updates: next_forward"),
    ("opt-par-cpu-rc-next", {"optimizer": "cpu", "params": "cpu", "defer_updates": "next_forward"},
     {"units": "all"}, "offload optimizer and params: cpu, recompute.units: all, "
     "offload.defer_updates: next_forward"),
    ("opt-cpu-delayed", {"optimizer": "cpu", "defer_updates": "delayed"}, None,
     "offload.optimizer: cpu, offload.defer_updates: delayed (gradients a step stale: other "
     "losses)"),
    ("opt-par-cpu-rc-gdev", {"optimizer": "cpu", "params": "cpu", "grads": "device"},
     {"units": "all"}, "offload optimizer and params: cpu, recompute.units: all, "
     "offload.grads: device (two units' gradient host buffers)"),
    ("opt-par-cpu-rc-gnull", {"optimizer": "cpu", "params": "cpu", "grads_in_flight": None},
     {"units": "all"}, "offload optimizer and params: cpu, recompute.units: all, "
     "offload.grads_in_flight: null (backward never waits for gradient copies)"),
)  # fmt: skip
# Variants whose numbers differ from zerocc-z3's by design (offload.defer_updates: delayed).
OWN_NUMERICS = frozenset({"zerocc-z3-opt-cpu-delayed"})


def offload_systems() -> dict[str, System]:
    """bench/offload.py's variants of the stage-3 systems, by name: zerocc with each option
    of ZEROCC_SAVINGS, FSDP2 with ``CPUOffloadPolicy`` (pinned, as by default, and not),
    DeepSpeed with its optimizer, and its parameters too, offloaded to the CPU."""
    systems = [
        System(
            f"zerocc-z3-{suffix}", "zerocc", 3,
            partial(zerocc_runner, stage=3, offload=offload, recompute=recompute),
            f"zerocc.compile, zero.stage 3, {what}", ("zerocc",),
        )
        for suffix, offload, recompute, what in ZEROCC_SAVINGS
    ]  # fmt: skip
    for suffix, policy in (("", {}), ("-unpinned", {"pin_memory": False})):
        systems.append(System(
            f"fsdp2-z3-offload{suffix}", "fsdp2", 3,
            partial(fsdp2_runner, reshard_after_forward=True, compiled=False, cpu_offload=policy),
            f"fully_shard(reshard_after_forward=True, offload_policy=CPUOffloadPolicy("
            f"{', '.join(f'{k}={v}' for k, v in policy.items())})), eager",
            ("torch.distributed.fsdp",),
        ))  # fmt: skip
    for suffix, param in (("opt", None), ("opt-par", "cpu")):
        systems.append(System(
            f"deepspeed-z3-offload-{suffix}", "deepspeed", 3,
            partial(deepspeed_runner, stage=3, offload_optimizer="cpu", offload_param=param),
            "deepspeed.initialize, zero_optimization.stage 3, offload_optimizer.device cpu"
            + (", offload_param.device cpu" if param else "") + ", torch AdamW",
            ("deepspeed",),
        ))  # fmt: skip
    return {s.name: s for s in systems}


def expert_systems() -> dict[str, System]:
    """Expert parallelism, for ``bench/compare.py --model mixtral`` (named, not in ``all``: a
    dense model has no experts to split): zerocc stage 3 with each layer's experts split over
    every rank."""
    system = System(
        "zerocc-z3-ep", "zerocc", 3, partial(zerocc_runner, stage=3, expert_parallel=True),
        "zerocc.compile, zero.stage 3, parallel.ep: world size", ("zerocc",),
    )  # fmt: skip
    return {system.name: system}


def float8_systems() -> dict[str, System]:
    """float8 matmuls (issue 51), named, for ``compare.py --gpu --dtype bf16``, each beside its
    bf16 twin: zerocc stage 3 on Inductor with ``precision.matmul: fp8`` (``zerocc-z3-inductor``
    its twin), and torchao's float8 layers under ``torch.compile`` (``torch-compiled``), for
    both of torchao's recipes."""
    systems = []
    for recipe in ("tensorwise", "rowwise"):
        systems.append(System(
            f"zerocc-z3-inductor-fp8-{recipe}", "zerocc", 3,
            partial(zerocc_runner, stage=3, backend="inductor", float8=recipe),
            f"zerocc.compile, zero.stage 3, backend inductor, precision.matmul: fp8 ({recipe})",
            ("zerocc", "torchao.float8"), compiled=True, float8=True,
        ))  # fmt: skip
        systems.append(System(
            f"torch-compiled-fp8-{recipe}", "torch", 0,
            partial(torch_runner, compiled=True, float8=recipe),
            f"unsharded, torchao convert_to_float8_training ({recipe}), torch.compile(model)",
            ("torch._inductor.compile_fx", "torchao.float8"), compiled=True, float8=True,
        ))  # fmt: skip
    return {s.name: s for s in systems}
