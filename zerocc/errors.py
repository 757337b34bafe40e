"""The errors zerocc raises on purpose.

Every error zerocc means to show a user derives from `ZeroccError`; the CLI prints such an error
as one line and exits with status 2 instead of showing a traceback.
"""


class ZeroccError(Exception):
    """Base class of every error zerocc raises on purpose; anything else is a bug."""


class PlanError(ZeroccError, ValueError):
    """Raised when a plan (or the workload it names) cannot be loaded or is invalid.

    The message names the plan file, the dotted YAML path of each bad field, the bad value and
    what is allowed there.
    """


class DeviceError(PlanError):
    """Raised before anything touches CUDA when the plan's ``backend.device`` cannot be served
    where the rank runs: CUDA asked for on a machine without a GPU, or more ranks on a machine
    than it has GPUs (each rank needs its own). The message says what to launch instead."""


class CaptureError(ZeroccError):
    """Raised when the training step of a model cannot be captured as one graph."""


class PassOrderError(PlanError):
    """Raised before any pass runs when the plan's `passes` break a pass's contract (a pass
    before what it requires, after what it must precede, or no pass producing what a training
    step needs): a plan error, naming ``passes[i]`` and the order the passes allow."""


class RankMismatchError(ZeroccError):
    """Raised when ranks disagree: a different world size than the plan expects, or programs
    whose hashes differ across ranks (the message names the first differing node)."""


class NotSupportedError(ZeroccError):
    """Raised when a plan or model asks for something zerocc does not support yet."""


class InvariantError(ZeroccError):
    """Raised (under ``ZEROCC_VERIFY=1``) when a pass leaves a graph that breaks an IR invariant;
    the message names the pass and the first offending node."""


class OffloadError(ZeroccError):
    """Raised when offloaded state cannot be placed or moved: an ``nvme_path`` that does not
    exist or is not writable, too little disk for the states, a disk that fills up (or a file
    that does not read back) during training. The message names the path and the bytes."""


class CheckpointError(ZeroccError):
    """A checkpoint that cannot be saved or loaded: a rank's write failed, files missing or
    corrupted, or a checkpoint of another model or optimizer."""


class NonFiniteError(ZeroccError):
    """Raised on every rank when a step's reduced gradient holds an inf or NaN and the plan says
    ``precision.on_nonfinite: error`` (the default without loss scaling). The message names the
    step and the first unit whose gradient was not finite; the update wrote nothing."""


class InsufficientMemoryError(ZeroccError, MemoryError):
    """Raised on every rank, before the memory is allocated, when a plan's predicted per-rank
    peak times the ranks sharing a machine's memory exceeds what that machine has available:
    the model states when the step is compiled, the step's activations, gathered units and host
    buffers before its first run. The message gives the figures, the shortfall and the plan
    changes that would fit; ``backend.check_memory: false`` goes on anyway."""


class RankStoppedError(ZeroccError):
    """Raised on every rank still running when a peer stopped answering: it was stopped, hung,
    killed or exited while the others waited for it in a collective longer than
    ``backend.timeout_s``. The message names the silent rank(s), the step and the op;
    ``silent`` holds what the heartbeats told of them
    (``zerocc.engine.watchdog.PeerState``: rank, pid, host, last status), for launchers
    that stop them."""

    def __init__(self, message: str, silent: list | tuple = ()) -> None:
        super().__init__(message)
        self.silent = list(silent)


class DataExhaustedError(ZeroccError):
    """Raised on every rank when some ranks ran out of batches while others still had one: the
    message names the ranks and the step. (When every rank runs out at the same step, training
    simply ends.)"""


class BatchError(ZeroccError):
    """Raised when a batch cannot be trained on: the program compiled for a new batch signature
    failed on its first run (a dtype the model does not take, say). The message names the op and
    how the batch differs from earlier ones; the failed program is not kept."""


class PlanWarning(UserWarning):
    """Warned when a plan is valid but likely not what its author wants (e.g. fp16 compute
    without loss scaling)."""


class RenamedFieldWarning(PlanWarning, FutureWarning):
    """Warned when a plan names a field by its old name: it is read under the new one, and the
    warning says which (``checkpointing:`` is ``recompute:``, ``offload.pipeline:`` is
    ``offload.defer_updates:``)."""


class LoweringWarning(UserWarning):
    """Warned when ranks lowered one program differently (one rank's Inductor rejected what
    another's compiled): the collectives are the same, so it trains, but each rank's compute
    rounds its own way and the slowest form sets the pace. The message names each rank's form;
    each rank's ``explain()`` says why."""
