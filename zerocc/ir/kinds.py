"""The IR's vocabularies: what a placeholder holds (:class:`Role`), where an op runs
(:class:`Stream`), and what an op does (:class:`OpKind`, read by :func:`zerocc.ir.nodes.op_kind`).

String enums: a member equals its value, so records, printed programs and JSON read the same as
plain strings, and a misspelled name is an AttributeError instead of a silent mismatch.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What the runtime binds to a placeholder, or what later passes act on in a node."""

    PARAM_FULL = "param_full"  # a unit's whole flat parameter, replicated (stages 0-2)
    PARAM_SHARD = "param_shard"  # the slice of a unit's flat parameter this rank owns, updates
    PARAM = "param"  # one original parameter (only in the captured graph)
    GRAD = "grad"  # a unit's gradient accumulator (full flat for stages 0-1, shard for 2-3)
    OPTIM_STATE = "optim_state"  # optimizer state of a unit's shard (exp_avg, ...)
    BUFFER = "buffer"  # a module buffer, replicated
    BATCH = "batch"  # one tensor of the micro-batch
    STEP = "step"  # the optimizer step counter (int64 scalar)
    LR = "lr"  # the learning rate of the step (fp64 scalar), set from the plan's schedule
    MASTER = "master"  # the weights the optimizer updates, when their dtype differs from param
    LOSS_SCALE = "loss_scale"  # the loss scale (fp32 scalar) backward is seeded with
    # Pipeline stages (zerocc.compiler.parallel.stage_cut): a tensor the neighbouring stage
    # sent (an activation in forward, a gradient in backward), and one the stage's own forward
    # kept for its backward.
    RECEIVED = "received"
    STASHED = "stashed"
    # Roles of computed nodes that later passes act on.
    GATHERED = "gathered"  # a unit's all-gathered flat parameter (stage 3)
    GRAD_SHARD = "grad_shard"  # the reduced gradient a unit's optimizer update reads
    FOUND_INF = "found_inf"  # 1.0 when a gradient overflowed on any rank: the update is skipped


class Stream(StrEnum):
    """Where an op runs: compute, collectives, the copy engine's copies (offload), or the
    host's worker thread (offloaded updates a plan defers into the next step)."""

    COMPUTE = "compute"
    COMM = "comm"
    COPY = "copy"
    HOST = "host"


class OpKind(StrEnum):
    """What a node does, as the cost model, the simulator, the liveness analysis and the
    verifier all read it."""

    PLUMBING = "plumbing"  # placeholders, the output, getitem: nothing runs
    COMPUTE = "compute"  # reads inputs and writes a result (in-place ops included)
    VIEW = "view"  # a view of an input that writes nothing
    COLLECTIVE = "collective"  # a collective's start (``*_start`` of zerocc's collectives)
    TRANSFER = "transfer"  # an offload copy's start (device, host, NVMe)
    WAIT = "wait"  # completes a collective or a copy
    FREE = "free"  # releases a buffer's storage
    RNG = "rng"  # reads or sets a random generator's state (recompute's replay)
