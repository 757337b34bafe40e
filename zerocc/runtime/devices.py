"""Which device a rank runs on, and the default process group that goes with it.

One rule, used by ``zerocc.compile`` and by the ranks that ``zerocc train`` / ``zerocc
profile`` launch: the plan's ``backend.device`` (``auto``: CUDA when this machine has a GPU,
else CPU), and on CUDA each rank on a GPU of its own, ``cuda:LOCAL_RANK``. It is checked
before anything touches CUDA: a rank that asks for a GPU the machine lacks stops with a
:class:`~zerocc.errors.DeviceError` saying what to launch instead, on every rank of the machine,
instead of one of them dying in "invalid device ordinal".

Two ranks never share a GPU: NCCL refuses it ("Duplicate GPU detected"), and gloo cannot
reduce-scatter CUDA tensors, so no plan field offers it; ``backend.device: cpu`` runs any
number of ranks on the CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zerocc.compiler.plan import Plan
from zerocc.errors import DeviceError
from zerocc.local_ranks import local_rank as launcher_local_rank
from zerocc.local_ranks import ranks_on_this_machine


def rank_device(
    plan: Plan, local_rank: int | None = None, local_ranks: int | None = None
) -> torch.device:
    """This rank's device: ``cpu``, or ``cuda:LOCAL_RANK``.

    ``local_rank`` (this rank's index on its machine) and ``local_ranks`` (how many ranks run on
    the machine) default to torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (without the
    latter, ``local_rank + 1``); a launcher passes its own to check before starting any rank.
    Raises DeviceError when the plan asks for CUDA (or ``auto`` finds a GPU) and the machine has
    no GPU, or fewer GPUs than ranks: every rank of the machine raises, not just those left
    without one, so that none waits for the others. Counting the GPUs is the only CUDA call.
    """
    wanted = plan.backend.device
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            "backend.device: 'cuda' asked for, but no CUDA device is available on this "
            f"machine (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
            "allowed here: auto, cpu"
        )
    if local_rank is None:
        local_rank = launcher_local_rank()
    if local_ranks is None:
        local_ranks = ranks_on_this_machine(unknown=local_rank + 1)
    gpus = torch.cuda.device_count()
    if max(local_ranks, local_rank + 1) > gpus:
        asked = "'auto' (this machine has a GPU)" if wanted == "auto" else "'cuda'"
        raise DeviceError(
            f"backend.device: {asked}: {max(local_ranks, local_rank + 1)} ranks run on this "
            f"machine, but it has {gpus} GPU(s) visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); each rank needs a GPU of "
            "its own (rank i of a machine runs on cuda:i; NCCL does not run two ranks on one "
            f"GPU). Launch at most {gpus} rank(s) per machine (`zerocc train --nproc {gpus}`, "
            f"`torchrun --nproc-per-node {gpus}`), or set backend.device: cpu to run every "
            "rank on the CPU"
        )
    return torch.device("cuda", local_rank)


def join_default_group(device: torch.device) -> None:
    """Under a launcher (``WORLD_SIZE`` > 1) with no default process group yet, create it: NCCL
    for ranks on CUDA, gloo on CPU. zerocc's own groups are made over it
    (:meth:`zerocc.engine.comm.TorchComm.create`); it only gives them the ranks and the
    store. The rank's GPU is made current first (:func:`use_device`), as NCCL expects."""
    use_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, **_attempt_store())


def _attempt_store() -> dict:
    """Under torchrun's agent store (its static rendezvous keeps one store for every attempt),
    the store with this attempt's keys apart: after a restart (``--max-restarts``) a rank
    would otherwise read the previous attempt's addresses of its peers, dead processes
    (gloo: "connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712 is the same
    under the c10d rendezvous). Elsewhere nothing: the launcher's own rendezvous."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False
    )
    return {
        "store": dist.PrefixStore(f"zerocc/attempt-{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": world_size,
    }


def use_device(device: torch.device) -> None:
    """Make a rank's GPU the current one, so that whatever runs on the current device (a
    stream or an event made without one, NCCL's own setup) runs on the rank's GPU, not on
    cuda:0 for every rank. Nothing to do on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
