"""Loading a checkpoint into a step of any world size, stage, units, precision or offload.

Each rank reads only the chunks that overlap what it holds (its shard of each flat, or the
whole flat it keeps), checks each against the manifest's SHA-256, and casts to its own dtypes.
What the checkpoint and the step must share is the model (every parameter and buffer, by name
and shape) and the optimizer; anything else may change, and what changes how training goes on
is said in the returned notes. Every rank learns whether every other rank loaded: a rank whose
files are missing or corrupted fails the load everywhere, never a rank left waiting.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.plan import OptimizerConfig, Plan
from zerocc.compiler.schedule import lr_at
from zerocc.compiler.state import optimizer_states
from zerocc.engine.comm import Comm
from zerocc.runtime.checkpoint.agreement import agree, attempt, gathered
from zerocc.runtime.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    DataReader,
    Manifest,
    read_elements,
    resolve,
)
from zerocc.runtime.checkpoint.layout import (
    STEP_TENSOR,
    FlatState,
    loaded_states,
    rng_name,
    weight_name,
)

if TYPE_CHECKING:
    from zerocc.runtime.checkpoint.checkpointed import Checkpointed

# Elements [start, stop) of a saved tensor (all of them by default), checked, flattened.
Read = Callable[..., torch.Tensor]


def load_checkpoint(runner: Checkpointed, path: str | Path) -> tuple[Path, list[str]]:
    """Load the checkpoint ``path`` names (a checkpoint, or a folder of them: its newest)
    into ``runner``; returns the checkpoint's folder and notes on what differs from the run
    that saved it. Call on every rank, before the first step or between steps."""
    runner.apply_carried_update()  # (offload.defer_updates) none left to apply over what loads
    folder, manifest = open_checkpoint(runner, path)
    notes = restore_counters(runner, manifest.meta)
    fill_state(runner, folder, manifest)
    return folder, notes


def open_checkpoint(runner: Checkpointed, path: str | Path) -> tuple[Path, Manifest]:
    """The checkpoint ``path`` names, found alike by every rank and checked to be of
    ``runner``'s model and optimizer: its folder and manifest (nothing loaded yet);
    CheckpointError on every rank when any rank cannot read it or it does not fit."""
    folder = Path(path)
    manifest: Manifest | None = None

    def find() -> None:  # (on every rank: one that cannot see the folder fails with the rest)
        nonlocal folder, manifest
        folder = resolve(path)
        manifest = Manifest.read(folder)
        check_compatible(runner.full_model_info, runner.plan.optimizer, manifest)

    agree(runner.comm, attempt(find), f"load of {path}", "nothing was loaded")
    assert manifest is not None
    _agree_on_checkpoint(runner.comm, path, folder)
    return folder, manifest


def fill_state(runner: Checkpointed, folder: Path, manifest: Manifest) -> None:
    """Read what ``runner`` holds of the checkpoint at ``folder`` into its state (weights,
    optimizer states, buffers, the step tensor) and, on as many ranks as saved it, each rank's
    random number generators; a rank that fails fails it on every rank."""
    agree(
        runner.comm,
        attempt(lambda: _load(runner, folder, manifest)),
        f"load of {folder}",
        "nothing was loaded",
    )


def _agree_on_checkpoint(comm: Comm, path: str | Path, folder: Path) -> None:
    """Every rank found the same checkpoint (its manifest, byte for byte, holds every chunk's
    SHA-256): CheckpointError on every rank, before any reads, when not. Each rank resolves
    ``path`` itself, so a folder copied to each host whose newest checkpoints differ, or a
    save landing between two ranks' looks, would load a model made of two steps."""
    manifest_digest = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()[:16]
    seen = f"{folder.name} (manifest {manifest_digest})"
    views = gathered(comm, seen, "choice of the checkpoint to load")
    if len(set(views)) > 1:
        found = "; ".join(f"rank {rank}: {view}" for rank, view in enumerate(views))
        raise CheckpointError(
            f"the ranks found different checkpoints at {path} ({found}): nothing was loaded; "
            "give every rank the same checkpoint (one shared folder, or the checkpoint's own "
            "folder named)"
        )


def check_compatible(info: ModelInfo, optimizer: OptimizerConfig, manifest: Manifest) -> None:
    """The checkpoint is of the model ``info`` describes (every parameter whole) and of
    ``optimizer``: CheckpointError naming what differs."""
    meta = manifest.meta
    mine = {p.fqn: p for p in (*info.params, *info.buffers)}
    saved = {**meta["params"], **meta["buffers"]}
    problems = []
    if missing := sorted(set(mine) - set(saved)):
        problems.append(f"it lacks {_names(missing)}")
    if extra := sorted(set(saved) - set(mine)):
        problems.append(f"this model has no {_names(extra)}")
    for fqn in sorted(set(mine) & set(saved)):
        if list(mine[fqn].shape) != saved[fqn]["shape"]:
            problems.append(f"{fqn} is {saved[fqn]['shape']} there, {list(mine[fqn].shape)} here")
    if problems:
        raise CheckpointError(
            "the checkpoint is of another model: " + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more differences" if len(problems) > 4 else "")
        )  # fmt: skip
    states = list(optimizer_states(optimizer))
    name = optimizer.name
    if meta["optimizer"]["name"] != name or meta["optimizer"]["states"] != states:
        raise CheckpointError(
            f"the checkpoint's optimizer is {meta['optimizer']['name']} with states "
            f"{meta['optimizer']['states']}, this plan's is {name} with {states}: its "
            "optimizer state cannot be loaded (to start a new optimizer from its weights, "
            "export them: zerocc export)"
        )


def _names(fqns: list[str]) -> str:
    return ", ".join(fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")


def _load(runner: Checkpointed, folder: Path, manifest: Manifest) -> None:
    reader = DataReader(folder, manifest.checksum)
    read = functools.partial(read_elements, manifest, reader)
    try:
        optim = optimizer_states(runner.plan.optimizer)
        for flat in loaded_states(runner.units, runner.layout, optim):
            _fill(runner, flat, read)
        for buffer in runner.session.model_info.buffers:
            if buffer.fqn in runner.state:
                target = runner.state[buffer.fqn]
                target.copy_(read(weight_name(buffer.fqn)).view(target.shape))
        if "optim.step" in runner.state:
            runner.state["optim.step"].copy_(read(STEP_TENSOR).view(()))
        _restore_random_state(runner, manifest, read)
    finally:
        reader.close()


def _fill(runner: Checkpointed, flat: FlatState, read: Read) -> None:
    """Fill one flat state from the saved tensors: the pieces this rank holds, cast to the
    flat's dtype, padding zero."""
    spec, splits, mesh, rank = flat.spec, runner.session.splits, runner.mesh, runner.comm.rank
    values = torch.zeros(spec.shape, dtype=spec.dtype)
    for piece in flat.pieces(mesh.group_rank(flat.unit.group, rank), whole=True):
        name = flat.name(piece.param)
        split = splits.get(piece.param.fqn)
        if split is None:
            part = read(name, piece.start, piece.stop)
        else:  # this rank's rows of the whole tensor (its tp slice, or its experts): read
            # their span, keep them
            row = split.row(piece.param.param.shape)
            at = mesh.group_rank(split.group, rank)
            where = split.to_whole(torch.arange(piece.start, piece.stop), at, row)
            first, last = int(where[0]), int(where[-1])
            part = read(name, first, last + 1)[where - first]
        values[piece.at : piece.at + piece.stop - piece.start].copy_(part)
    runner.state.write(spec.key, values)  # (to its NVMe file where it is placed there)


def restore_counters(runner: Checkpointed, meta: dict[str, Any]) -> list[str]:
    """Step counters and the loss scaler from a checkpoint's ``meta``; notes on what differs
    from the run that saved it, and what could not be carried over (:func:`resume_notes`)."""
    runner.steps = meta["optimizer_steps"]
    runner.micro_batches = meta["step"] * runner.plan.grad_accumulation
    scaler = meta["loss_scaler"]
    if runner.loss_scaler is not None and scaler is not None:
        runner.loss_scaler.load_state_dict(scaler)
    return resume_notes(runner.plan, runner.comm.world_size, meta)


def resume_notes(plan: Plan, world_size: int, meta: dict[str, Any]) -> list[str]:
    """What a run of ``plan`` on ``world_size`` ranks that resumes from a checkpoint (its
    ``meta``) does otherwise than the run that saved it, and what it cannot carry over: a
    line each (none: it goes on as that run would)."""
    notes = []
    accum = plan.grad_accumulation
    if accum != meta["plan"]["grad_accumulation"]:
        notes.append(
            f"grad_accumulation {meta['plan']['grad_accumulation']} -> {accum}: step "
            f"{meta['step']} goes on with {accum} micro-batches per step"
        )
    scaler, scales = meta["loss_scaler"], plan.precision.scaling != "none"
    if scales and scaler is None:
        notes.append("the checkpoint had no loss scaling: the scale starts at the plan's initial")
    elif scaler is not None and not scales:
        notes.append(f"the checkpoint's loss scale ({scaler['scale']:g}) is dropped: this plan "
                     "scales no loss")  # fmt: skip
    saved_optimizer = meta["plan"]["optimizer"]
    notes.extend(_schedule_notes(plan.optimizer, meta["optimizer_steps"], saved_optimizer))
    if meta["stage"] != plan.zero.stage:
        notes.append(f"saved at ZeRO stage {meta['stage']}, resharded for stage "
                     f"{plan.zero.stage}")  # fmt: skip
    saved_parallel = {"tp": 1, "pp": 1, "ep": 1, **meta["plan"].get("parallel", {})}
    for axis in ("tp", "pp", "ep"):
        theirs, ours = saved_parallel[axis], getattr(plan.parallel, axis)
        if theirs != ours:
            notes.append(f"saved under parallel.{axis}: {theirs}, resharded for {ours}")
    if meta["world_size"] != world_size:
        draws = (
            "random ops draw from their keys (capture.draws: keyed: a micro-batch's dropout "
            "masks follow its step and place in the global batch)"
            if plan.capture.draws == "keyed"
            else "each rank's random number generator goes on from where it is (dropout "
            "draws differ from a run that did not stop; capture.draws: keyed makes them not)"
        )
        notes.append(
            f"saved on {meta['world_size']} ranks, loaded on {world_size}: "
            f"{draws}, and each rank's data is what the workload gives this world size"
        )
    return notes


def _restore_random_state(runner: Checkpointed, manifest: Manifest, read: Read) -> None:
    """Each rank's random number generators as that rank saved them, on the world size that
    saved them (on another, each goes on from where it is: :func:`restore_counters` notes
    it)."""
    rank = runner.comm.rank
    if manifest.meta["world_size"] != runner.comm.world_size:
        return
    torch.set_rng_state(read(rng_name(rank, "cpu")))
    if runner.device.type == "cuda" and rng_name(rank, "cuda") in manifest.tensors:
        torch.cuda.set_rng_state(read(rng_name(rank, "cuda")), runner.device)


def _schedule_notes(ours: OptimizerConfig, steps: int, saved: dict[str, Any]) -> list[str]:
    """The schedule goes on from the applied-step count (``steps``); a note when this plan's
    rates (``ours``) differ from the saving run's (another schedule, or another peak rate)."""
    theirs = OptimizerConfig.model_validate(saved)
    if (ours.lr, ours.schedule) == (theirs.lr, theirs.schedule):
        return []
    return [
        f"the learning rate differs from the saving run's (lr {theirs.lr:g}, schedule "
        f"{theirs.schedule.name} -> lr {ours.lr:g}, schedule {ours.schedule.name}): step "
        f"{steps + 1} runs at {lr_at(ours, steps):g}, this plan's rate at that step"
    ]
