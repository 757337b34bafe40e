"""Test-wide settings: IR invariants are verified after every pass; Triton kernels run
interpreted on CPU (set before anything imports triton, inherited by spawned ranks)."""

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("ZEROCC_VERIFY", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests import their helper modules (models, multirank) and the example GPT by name.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "gpt"))
