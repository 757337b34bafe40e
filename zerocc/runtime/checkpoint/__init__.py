"""Checkpoints by model name: saved under any world size, stage or units, loaded under any
other, atomic and checked (see :mod:`.files` for the format, :mod:`.layout` for the mapping).
"""

from zerocc.runtime.checkpoint.files import CheckpointError, Manifest, resolve
from zerocc.runtime.checkpoint.load import load_checkpoint
from zerocc.runtime.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "Manifest", "load_checkpoint", "resolve", "save_checkpoint"]
