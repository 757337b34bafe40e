"""A rank's state as ``torch.distributed.checkpoint`` saves it: its raw shards, optimizer state
and counters under rank-prefixed keys, reloaded only under the same plan and world size (for
checkpoints that load under any other, see :mod:`.save` and :mod:`.load`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerocc.compiler.parallel.dims import DIMENSIONS
from zerocc.errors import RankMismatchError

if TYPE_CHECKING:
    from zerocc.runtime.checkpoint.checkpointed import Checkpointed


def rank_state_dict(runner: Checkpointed) -> dict[str, Any]:
    """``runner``'s shards, optimizer state and counters, ready for
    ``torch.distributed.checkpoint.save`` (or ``torch.save``). Tensor keys carry the rank
    (``rank1/transformer.h.0.param``) since every rank holds different shards. Applies a
    pipelined offload's update in flight first, which under stages 1-2 all-gathers: call it on
    every rank then."""
    runner.apply_carried_update()
    sd: dict[str, Any] = dict(runner.state.state_dict())
    sd["zerocc"] = {
        "steps": runner.steps,
        "micro_batches": runner.micro_batches,
        **_sharding(runner),
    }
    if runner.loss_scaler is not None:
        sd["zerocc"]["loss_scaler"] = runner.loss_scaler.state_dict()
    return sd


def load_rank_state_dict(runner: Checkpointed, sd: dict[str, Any]) -> None:
    """Restore into ``runner`` what :func:`rank_state_dict` gave (after
    ``dcp.load(sd, ...)`` filled it in): RankMismatchError when it was saved sharded otherwise
    (world size, stage, a degree of the mesh that shapes a rank's state) or lacks a tensor of
    this rank."""
    restore_rank_counters(runner, sd)
    runner.state.load_state_dict(sd)


def restore_rank_counters(runner: Checkpointed, sd: dict[str, Any]) -> None:
    """The counters and loss scale of what :func:`rank_state_dict` gave, once checked to be
    of ``runner``'s sharding (its tensors not yet: a pipeline has none before its first
    call)."""
    runner.apply_carried_update()  # (offload.defer_updates) none left to apply over what loads
    saved = {**_BEFORE_THEIR_DIMENSIONS, **sd["zerocc"]}
    for field, mine in _sharding(runner).items():
        # A degree a checkpoint does not record otherwise was not saved when it was written
        # (ep, before the mesh's dimensions were saved): it loads as it did, unchecked.
        if field in saved and saved[field] != mine:
            raise RankMismatchError(
                f"checkpoint was saved with {field}={saved[field]}, this run has {field}={mine}"
            )
    runner.steps, runner.micro_batches = saved["steps"], saved["micro_batches"]
    if runner.loss_scaler is not None:
        runner.loss_scaler.load_state_dict(saved["loss_scaler"])


# Checkpoints written before hybrid sharding, tensor or pipeline parallelism existed: no
# replicas, no split (the manifest's layout before each of them was saved).
_BEFORE_THEIR_DIMENSIONS = {"replicate": 1, "tp": 1, "pp": 1}


def _sharding(runner: Checkpointed) -> dict[str, int]:
    """How ``runner`` shards its state: what a rank's state dict holds depends on it (the
    world size, the stage, and the degree of every mesh dimension that shapes it, by the
    degree's name: a new dimension is saved and checked with no change here)."""
    degrees = runner.mesh.degrees()
    return {
        "world_size": runner.comm.world_size,
        "stage": runner.plan.zero.stage,
        **{d.degree: degrees[d.degree] for d in DIMENSIONS if d.shapes_state},
    }
