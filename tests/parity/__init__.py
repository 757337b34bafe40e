"""The correctness oracle: N ranks against one process training on all ranks' batches.

``train`` runs in each spawned rank; ``reference`` runs in the test process with torch.optim on
the same model and the union of the ranks' micro-batches, summing each chunk's loss scaled by
1/(ranks × micro-batches), which is the gradient of the mean loss over all of them.

Under mixed precision the reference follows the recipe, written plainly: fp32 master weights
under torch.optim; each step, forward and backward of every micro-batch on a copy of the model
cast to the compute dtype (floating batch tensors cast too, the loss cast to fp32); gradients
summed in fp32 into the masters and divided by ranks × micro-batches; fp16 losses scaled by
``torch.amp.GradScaler`` (unscale, clip, skip on overflow, update the scale). A plan that keeps
gradient shards in a 16-bit ``precision.grad`` (stages 2-3) has each micro-batch's gradient,
summed over ranks, rounded to that dtype and added into an accumulator of it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from models import TP_LAYERS, build, entry, loss_of
from optional_deps import marked, runnable
from tp_emulation import emulated

import zerocc
from parity.lion import Lion
from zerocc.compiler.capture import describe_model
from zerocc.compiler.passes.partition import assign_units
from zerocc.compiler.plan.optimizers import OPTIMIZERS
from zerocc.compiler.state import offloaded_units
from zerocc.inspect.explain import describe


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={_show(v)}" for k, v in value.items())
    return str(value)


def case_id(case: dict[str, Any]) -> str:
    extras = [
        f"{k}={_show(v)}"
        for k, v in sorted(case.items())
        if k not in ("model", "stage", "world", "steps", "slow")
    ]
    return "-".join([case["model"], f"zero{case['stage']}", f"ws{case['world']}", *extras])


def sweep(cases: list[dict[str, Any]]) -> list[Any]:
    """``cases`` for ``parametrize``: those this machine cannot run marked to skip with why
    (tests/optional_deps.py), and those a sweep's other cases cover (``"slow": True``) marked
    slow, run with ``pytest --slow``. Each of the two kinds trains in a run of its own
    (:func:`of_speed`), so that the default run trains none of the slow ones."""
    out = []
    for case, param in zip(cases, marked(cases), strict=True):
        marks = list(getattr(param, "marks", ())) + [pytest.mark.slow] * bool(case.get("slow"))
        out.append(pytest.param(case, marks=marks) if marks else case)
    return out


def of_speed(cases: list[dict[str, Any]], slow: bool) -> list[dict[str, Any]]:
    """The cases of ``cases`` this machine can run that are slow (or not)."""
    return [c for c in runnable(cases) if bool(c.get("slow")) == slow]


def is_slow(case: dict[str, Any]) -> bool:
    return bool(case.get("slow"))


Run = TypeVar("Run", bound=Callable[..., Any])


def run_once(function: Run) -> Run:
    """``function`` called once per set of arguments, its defaults filled in first:
    ``functools.cache`` keys ``_results()`` and ``_results(False)`` apart, and ran a test
    file's batch of ranks twice where one test passed the default and another named it."""
    signature = inspect.signature(function)
    cached = functools.cache(function)

    @functools.wraps(function)
    def called(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return cached(*bound.args, **bound.kwargs)

    return called  # type: ignore[return-value]


# The backend of the cases that name none: the run's (``pytest --backend``, tests/conftest.py),
# read from the environment so that the spawned ranks see it too.
BACKEND_VARIABLE = "ZEROCC_TEST_BACKEND"


def backend_of(case: dict[str, Any]) -> str:
    """The backend ``case`` trains with: its own, else the run's (eager by default)."""
    return case.get("backend", os.environ.get(BACKEND_VARIABLE, "eager"))


SEED = 7  # the plans' seed: the keys of their draws (``capture.draws: keyed``)


def plan_of(case: dict[str, Any]) -> dict[str, Any]:
    optimizer = case.get(
        "optimizer", {"name": "adamw", "lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01}
    )
    pipeline = {}
    if "pp" in case:  # its micro-batches are the pipeline's (they accumulate there)
        pipeline = {"schedule": case.get("schedule", "1f1b"), "microbatches": case["accum"]}
        pipeline |= {"gather": case["gather"]} if "gather" in case else {}
    return {
        "zero": {
            "stage": case["stage"],
            "replicate": case.get("replicate", 1),
            "secondary_group": case.get("secondary", 1),
        },
        "parallel": _parallel(case),
        "pipeline": pipeline,
        "units": {**entry(case["model"])[2], **case.get("units", {})},
        "optimizer": optimizer,
        "grad_accumulation": 1 if pipeline else case.get("accum", 1),
        "precision": case.get("precision", {}),
        "backend": {
            "name": backend_of(case),
            "kernels": case.get("kernels", "torch"),
            "device": case.get("device", "cpu"),
        },
        "overlap": case.get("overlap", {}),
        "offload": case.get("offload", {}),
        "recompute": case.get("recompute", {}),
        "capture": {"draws": "keyed"} if case.get("keyed") else {},
        "seed": SEED,
    }


def _parallel(case: dict[str, Any]) -> dict[str, Any]:
    """The plan's ``parallel`` section of the case: its tensor, pipeline and expert
    parallelism."""
    parallel: dict[str, Any] = {"pp": case["pp"]} if "pp" in case else {}
    parallel |= {"ep": case["ep"]} if "ep" in case else {}
    if "tp" in case:
        parallel |= {
            "tp": case["tp"],
            "tp_layers": TP_LAYERS[case["model"]],
            "sequence_parallel": case.get("sp", False),
        }
    return parallel


def tp_of(case: dict[str, Any]) -> int:
    """Tensor-parallel ranks of the case (1 without)."""
    return case.get("tp", 1)


def data_ranks(case: dict[str, Any]) -> int:
    """Batches per step: one per data-parallel rank (a tp group's ranks share theirs, and a
    pipeline's)."""
    return case["world"] // (tp_of(case) * case.get("pp", 1))


def batch_of(case: dict[str, Any], index: int, rank: int):
    make = entry(case["model"])[1]
    steps = case.get("steps", 5) * case.get("accum", 1)
    if case.get("short_last") and index == steps - 1:
        return make(index, rank, 1)
    return make(index, rank)


def _model(case: dict[str, Any], rank: int = 0) -> torch.nn.Module:
    """The case's model as ``rank`` builds it: seeded alike on every rank, unless the case says
    ``rank_seeds`` (each rank its own seed, a common mistake zerocc must undo as DDP does: every
    rank starts from rank 0's weights, which the reference, built as rank 0, trains)."""
    seed = 7919 * rank if case.get("rank_seeds") else 0
    if case.get("meta"):
        with torch.device("meta"):
            return build(case["model"], seed)
    return build(case["model"], seed)


def train(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case on this rank: losses per micro-batch, comm of the last step, full params."""
    out = {}
    for case in cases:
        if case_id(case) in out:  # (a twin several pairs share: trained once)
            continue
        step = zerocc.compile(_model(case, rank), plan_of(case))
        k, losses = case.get("accum", 1), []
        for i in range(case.get("steps", 5) * k):
            losses.append(float(step(*batch_of(case, i, step.data_rank))))
        elements = dict(step.comm.stats.elements)  # of the last step's program alone
        params = step.full_state_dict()  # collective: every rank calls it
        out[case_id(case)] = {
            "losses": losses,
            "elements": elements,
            "psi": sum(u.padded_numel for u in step.units if u.trainable),
            "figures": describe(step.record()),
            "backend_notes": step.record().backend_notes,
            "params": params if rank == 0 else None,
        }
    return out


def _optimizer(case: dict[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cfg = plan_of(case)["optimizer"]
    if cfg["name"] == "adamw":
        opt = torch.optim.AdamW(
            params, lr=cfg["lr"], eps=cfg["eps"], weight_decay=cfg.get("weight_decay", 0.0)
        )
    elif cfg["name"] == "sgd" and set(cfg) <= {"name", "lr", "momentum", "weight_decay"}:
        opt = torch.optim.SGD(
            params,
            lr=cfg["lr"],
            momentum=cfg.get("momentum", 0.0),
            weight_decay=cfg.get("weight_decay", 0.0),
        )
    else:  # the registry's other optimizers: torch.optim's own, with the plan's fields
        fields = {k: tuple(v) if k == "betas" else v for k, v in cfg.items()
                  if k not in ("name", "grad_clip", "schedule")}  # fmt: skip
        opt = OPTIMIZER_CLASSES[cfg["name"]](params, **fields)
    return opt


# The torch.optim class of each optimizer the plan names (Lion, not in torch.optim: the paper's).
OPTIMIZER_CLASSES = {
    name: getattr(torch.optim, kind.torch_name) if kind.torch_name else Lion
    for name, kind in OPTIMIZERS.items()
    if not kind.whole_tensors
}


def torch_scheduler(schedule: dict[str, Any], optimizer: torch.optim.Optimizer):
    """Trainer's schedule ``schedule`` as torch's schedulers on ``optimizer``."""
    from torch.optim import lr_scheduler

    warmup = schedule.get("warmup_steps", 0)
    ramp = lr_scheduler.LambdaLR(optimizer, lambda n: n / max(1, warmup) if n < warmup else 1.0)
    if schedule["name"] == "constant":
        return ramp
    span = schedule["total_steps"] - warmup
    base = optimizer.param_groups[0]["initial_lr"]
    if schedule["name"] == "linear":
        floor = schedule.get("min_lr", 0.0) / base
        decay = lr_scheduler.LinearLR(optimizer, 1.0, floor, total_iters=span)
    else:
        decay = lr_scheduler.CosineAnnealingLR(optimizer, span, eta_min=schedule.get("min_lr", 0))
    return lr_scheduler.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])


def _scheduler(case: dict[str, Any], opt: torch.optim.Optimizer):
    schedule = plan_of(case)["optimizer"].get("schedule")
    return torch_scheduler(schedule, opt) if schedule else None


def reference(case: dict[str, Any]) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Losses per rank per micro-batch, and the final state dict (on the CPU), of unsharded
    training on the case's device: the device the ranks ran on. Another device's kernels round
    bf16 differently (the GPU's matmuls accumulate in another order than the CPU's), and Adam
    turns a flipped last bit into a step of lr: a CPU reference of a bf16 run on CUDA differed by
    1.6e-2 (issue 16), as this CPU's own kernels on 2 threads instead of 1 differ by 8e-3."""
    model = _model(case)
    if case.get("meta"):
        zerocc.materialize(model, seed=7)
    model.to(_device(case))
    # One thread, as in the ranks: a CPU kernel that splits its fp32 accumulation over another
    # number of threads rounds differently (bf16 results visibly, fp32 ones in the last bit).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = _mixed_reference if plan_of(case)["precision"] else _fp32_reference
        losses, state = run(case, model)
        return losses, {name: value.cpu() for name, value in state.items()}
    finally:
        torch.set_num_threads(threads)


def _fp32_reference(case: dict[str, Any], model: torch.nn.Module):
    if case.get("offload", {}).get("defer_updates") == "delayed":
        return _delayed_reference(case, model)
    cfg = plan_of(case)["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(case, params)
    scheduler = _scheduler(case, opt)
    losses: list[list[float]] = [[] for _ in range(data_ranks(case))]
    for s in range(case.get("steps", 5)):
        opt.zero_grad()
        _backward_step(case, model, s, losses)
        if cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        opt.step()
        if scheduler:
            scheduler.step()
    return losses, model.state_dict()


def _backward_step(
    case: dict[str, Any], model: torch.nn.Module, s: int, losses: list[list[float]]
) -> None:
    """Forward and backward of step ``s``'s micro-batches of every rank, each loss scaled by
    1/(ranks × micro-batches) into ``model``'s gradients and recorded in ``losses[rank]``."""
    world, k = data_ranks(case), case.get("accum", 1)
    for micro in range(k):
        for r in range(world):
            batch = _on_device(case, batch_of(case, s * k + micro, r))
            # (keyed: the draws of rank r's micro-batch, the global batch's r * k + micro)
            with zerocc.keyed_draws(SEED, s, r * k + micro) if case.get("keyed") else _NONE:
                loss = loss_of(model(*batch))
            losses[r].append(float(loss.detach()))
            (loss / (world * k)).backward()


_NONE = contextlib.nullcontext()


def _delayed_reference(case: dict[str, Any], model: torch.nn.Module):
    """ZeRO-Offload's delayed parameter update, fp32: step s computes its gradient (over its
    micro-batches) on the weights the model had before step s-1's update, while that update
    (step s-1's gradient, clipped by its own norm) is applied to the master weights, which the
    model gets after step s's last backward. The last step's update is applied at the end.
    Only the units ``offload.ratio`` puts on the host are delayed: the others' update, clipped
    by the same norm, is applied in its own step."""
    cfg = plan_of(case)["optimizer"]
    master = copy.deepcopy(model)
    late = _offloaded_params(case, model)
    trainable = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    params = [p for _, p in trainable]
    groups = {
        delayed: [p for n, p in trainable if (n in late) == delayed] for delayed in (True, False)
    }
    optimizers = {delayed: _optimizer(case, ps) for delayed, ps in groups.items() if ps}
    losses: list[list[float]] = [[] for _ in range(data_ranks(case))]
    pending: dict[torch.nn.Parameter, torch.Tensor | None] | None = None

    def apply(delayed: bool, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        if delayed in optimizers:
            for p in groups[delayed]:
                p.grad = grads[p]
            optimizers[delayed].step()

    for s in range(case.get("steps", 5)):
        model.zero_grad()
        _backward_step(case, model, s, losses)
        trained = [p for p in model.parameters() if p.requires_grad]
        for p, q in zip(params, trained, strict=True):
            p.grad = q.grad.clone() if q.grad is not None else None
        if cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        clipped = {p: p.grad for p in params}
        if pending is not None:
            apply(True, pending)
        apply(False, clipped)
        model.load_state_dict(master.state_dict())
        pending = clipped
    apply(True, pending)
    return losses, master.state_dict()


def _offloaded_params(case: dict[str, Any], model: torch.nn.Module) -> set[str]:
    """Names of the parameters in the units the case's ``offload.ratio`` offloads."""
    plan = zerocc.load_plan(plan_of(case))
    units = assign_units(
        describe_model(model), 1, plan.units.classes, plan.units.modules, plan.units.min_mb
    )
    return {p.fqn for u in offloaded_units(units, plan.offload.ratio) for p in u.params}


def _mixed_reference(case: dict[str, Any], model: torch.nn.Module):
    precision = zerocc.load_plan(plan_of(case)).precision
    compute = precision.dtype("param")
    cfg = plan_of(case)["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(case, params)
    scheduler = _scheduler(case, opt)
    scaler = None
    if precision.scaling == "dynamic":
        knobs = precision.dynamic
        assert knobs.hysteresis == 1, "GradScaler has no hysteresis"
        scaler = torch.amp.GradScaler(
            _device(case).type,
            init_scale=knobs.initial,
            growth_factor=knobs.growth_factor,
            backoff_factor=knobs.backoff_factor,
            growth_interval=knobs.growth_interval,
        )
    world, k = data_ranks(case), case.get("accum", 1)
    # Gradient shards kept in a 16-bit dtype (precision.grad, stages 2-3): each micro-batch's
    # reduced gradient is rounded to it, and accumulated in it.
    kept = precision.dtype("grad") if precision.grad and case["stage"] >= 2 else None
    kept = kept if kept != torch.float32 else None
    losses: list[list[float]] = [[] for _ in range(world)]
    for s in range(case.get("steps", 5)):
        cast = copy.deepcopy(model).to(compute)
        cast_params = [p for p in cast.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        for micro in range(k):
            if kept:  # the accumulator aside: p.grad sums this micro-batch over ranks
                accumulated = [p.grad for p in params]
                for p in params:
                    p.grad = torch.zeros_like(p)
            for r in range(world):
                batch = [
                    b.to(compute) if b.is_floating_point() else b
                    for b in _on_device(case, batch_of(case, s * k + micro, r))
                ]
                with _tp_arithmetic(case, cast):
                    loss = loss_of(cast(*batch)).float()
                losses[r].append(float(loss.detach()))
                seed = scaler.scale(loss) if scaler else loss
                grads = torch.autograd.grad(seed, cast_params, allow_unused=True)
                for p, g in zip(params, grads, strict=True):
                    if g is not None:
                        p.grad += g.float()
            if kept:
                for p, acc in zip(params, accumulated, strict=True):
                    p.grad = (acc.to(kept) + p.grad.to(kept)).float()
        for p in params:
            p.grad /= world * k
        if scaler:
            scaler.unscale_(opt)
        if cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        scale = scaler.get_scale() if scaler else None
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        # A step skipped for an overflow (the scale backed off) does not advance the schedule.
        if scheduler and not (scaler and scaler.get_scale() < scale):
            scheduler.step()
    return losses, model.state_dict()


def _tp_arithmetic(case: dict[str, Any], model: torch.nn.Module):
    """Under tensor parallelism, the model computing as the tp ranks round (see
    tests/tp_emulation.py); else as it is."""
    if "tp" not in case:
        return contextlib.nullcontext()
    return emulated(model, TP_LAYERS[case["model"]], case["tp"])


def _device(case: dict[str, Any]) -> torch.device:
    return torch.device(case.get("device", "cpu"))


def _on_device(case: dict[str, Any], batch: tuple) -> list:
    return [b.to(_device(case)) if isinstance(b, torch.Tensor) else b for b in batch]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / max(‖b‖, tiny): one number per tensor, robust to near-zero entries."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


# Under Inductor (a case's ``backend``, or ``pytest --backend inductor``) a test's tolerance is
# raised to these: Inductor fuses ops and reorders reductions (a layer norm's statistics, a
# softmax's sum, the loss's mean), so it rounds otherwise than the reference, and than another
# program it compiles, which the eager backend's exact comparisons (one rank against the
# reference, a pass on against off) assume away: moving a wait moves a boundary of its fusion,
# and one run's loss moved by an ulp (tests/parity/test_overlap_parity.py). fp32: a few ulps per
# op, ~1e-7 relative after three steps of the GPT, 1e-5 as the fp32 parity tests'. 16-bit
# compute: 1e-2 (test_mixed_precision_parity.py) on the losses and on each weight matrix; a
# vector parameter's gradient (a bias, a norm's) is a sum over every token of 16-bit terms that
# cancel, whose relative rounding no ulp bounds (1.9e-2 measured on a bias, 3 bf16 steps), so
# vector parameters are held to 1e-2 together, as one vector: up to 1.2e-3 measured (AdamW, 5
# steps), where a lost update of one bias moves it by tens of percent.
COMPILED_FP32 = 1e-5
COMPILED_LOW = 1e-2


def compiled(case: dict[str, Any]) -> bool:
    """Whether ``case`` trains under a compiling backend (Inductor, whole or by region)."""
    return backend_of(case) != "eager"


def _low_precision(case: dict[str, Any]) -> bool:
    return plan_of(case)["precision"].get("param", "fp32") in ("bf16", "fp16")


def tolerance_of(case: dict[str, Any], tol: float) -> float:
    """A test's relative tolerance ``tol`` for ``case``, raised for a compiling backend to
    :data:`COMPILED_LOW` (16-bit compute) or :data:`COMPILED_FP32`."""
    if not compiled(case):
        return tol
    return max(tol, COMPILED_LOW if _low_precision(case) else COMPILED_FP32)


def assert_trained_alike(
    ranks: list[dict[str, Any]],
    case: dict[str, Any],
    losses: list[list[float]],
    state: dict[str, torch.Tensor],
    tol: float,
) -> None:
    """Case ``case`` of every rank's results trained as ``losses`` (per rank, micro-batch by
    micro-batch) and ``state`` (the final weights, the same keys as ``model.state_dict()``) say,
    within ``tol`` relative (raised for a compiling backend, see :data:`COMPILED_FP32`)."""
    key, loss_tol = case_id(case), tolerance_of(case, tol)
    for rank, result in enumerate(ranks):
        ours, theirs = result[key]["losses"], losses[rank]
        assert len(ours) == len(theirs)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert abs(a - b) <= loss_tol * abs(b), f"rank {rank} micro-batch {i}: {a} vs {b}"
    params = ranks[0][key]["params"]
    assert set(params) == set(state), "full_state_dict keys differ from model.state_dict()"
    assert_weights_alike(params, state, case, tol)


def assert_weights_alike(
    params: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    case: dict[str, Any],
    tol: float,
) -> None:
    """Each of ``params`` within ``tol`` relative (raised for a compiling backend, see
    :data:`COMPILED_FP32`) of the same name's weight in ``state``, by norm: under a compiling
    backend in 16-bit compute, the vector parameters as one vector, and in bf16 a weight whose
    own rounding moves it further (:func:`_bf16_footprint`) within twice that."""
    together = compiled(case) and _low_precision(case)
    compiled_bf16 = compiled(case) and plan_of(case)["precision"].get("param") == "bf16"
    tol = tolerance_of(case, tol)
    vectors = [name for name in params if together and state[name].dim() < 2]
    groups = [[name] for name in params if name not in vectors] + ([vectors] if vectors else [])
    for names in groups:
        for name in names:
            assert params[name].dtype == state[name].dtype, name
        difference = relative_difference(_joined(params, names), _joined(state, names))
        bound = tol
        if difference > tol and compiled_bf16:
            bound = max(tol, 2 * _bf16_footprint(case, names))
        what = names[0] if len(names) == 1 else "vector parameters as one"
        assert difference <= bound, f"{what}: {difference:.2e} (bound {bound:.2e})"


# A weight of a compiled bf16 run is held to COMPILED_LOW, or where it is larger to twice its
# bf16 footprint: its distance, after the case's steps, between the bf16 recipe and the same
# training in fp32 arithmetic. A compiled program is another bf16 rounding of the recipe (fused
# ops keep their intermediates in fp32): where bf16's rounding itself moves a weight more than
# 1e-2 from exact arithmetic, another rounding lands as far from it, and the two roundings lie
# within the sum of their footprints of each other (Inductor's measured 0.7-1.3 times the
# recipe's). So it is for a mixture of experts' router: its top-2 picks flip on near ties, and
# Adam turns the flipped tokens' gradients into steps of lr. Measured (Mixtral, ZeRO-3, 2
# ranks, 5 AdamW steps): the routers lie 7.0e-2 and 7.7e-2 from fp32 in the recipe and 3.4e-2
# and 3.8e-2 from the recipe under Inductor, the experts' weights 1.4-1.7e-2 and 1.1-1.4e-2;
# the largest against its footprint, 1.44 times it, an expert-parallel router's (4.96e-2;
# tests/parity/test_expert_parallel_parity.py). Such a router's bound (0.15) exceeds its last
# step's move (0.11 of 0.37 in all): a lost step of it is the eager backend's comparisons' to
# catch (bit for bit against the recipe). fp16 keeps 1e-2: its loss scaling skips steps that
# fp32 training takes, so its footprint bounds nothing.
_FOOTPRINT_STATES: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _bf16_footprint(case: dict[str, Any], names: list[str]) -> float:
    """The relative distance of weights ``names`` (as one vector) between the bf16 recipe of
    ``case`` and the same training in fp32 arithmetic (both computed once per case)."""
    key = case_id(case)
    if key not in _FOOTPRINT_STATES:
        exact = {**case, "precision": {}}
        _FOOTPRINT_STATES[key] = (reference(case)[1], reference(exact)[1])
    recipe, exact = _FOOTPRINT_STATES[key]
    return relative_difference(_joined(recipe, names), _joined(exact, names))


def _joined(state: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([state[name].flatten() for name in names])


def assert_matches_reference(ranks: list[dict[str, Any]], case: dict[str, Any], tol: float) -> None:
    """Every rank's losses, micro-batch by micro-batch, and rank 0's full state dict (the same
    keys as ``model.state_dict()``) within ``tol`` relative of :func:`reference`."""
    ref_losses, ref_state = reference(case)
    per_rank = [ref_losses[rank // tp_of(case)] for rank in range(len(ranks))]
    assert_trained_alike(ranks, case, per_rank, ref_state, tol)


def assert_bit_identical(
    ranks: list[dict[str, Any]], on: dict[str, Any], off: dict[str, Any]
) -> None:
    """Case ``on`` (a pass turned on) trained exactly as case ``off``: every rank's losses equal,
    micro-batch by micro-batch, and rank 0's full state dicts equal, key by key, to the bit.
    Under a compiling backend, two programs compile to other kernels: held within its
    tolerance (:data:`COMPILED_FP32`)."""
    if compiled(on):
        losses = [result[case_id(off)]["losses"] for result in ranks]
        assert_trained_alike(ranks, on, losses, ranks[0][case_id(off)]["params"], 0.0)
        return
    for rank, result in enumerate(ranks):
        assert result[case_id(on)]["losses"] == result[case_id(off)]["losses"], f"rank {rank}"
    ours, theirs = ranks[0][case_id(on)]["params"], ranks[0][case_id(off)]["params"]
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
