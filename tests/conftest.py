"""Test-wide settings: IR invariants are verified after every pass; Triton kernels run
interpreted on a machine without CUDA (set before anything imports triton; spawned CPU ranks
always get it, see multirank.py); tests that need GPUs are marked, and skipped, with the reason,
where there are fewer.

Markers (the only place they are declared):
- ``cuda``: needs a CUDA GPU (NCCL on one rank, Triton kernels launched for real, the comm
  stream and its events, a plan on ``cuda``);
- ``two_gpus``: needs two CUDA GPUs on this machine (two NCCL ranks, one GPU each).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("ZEROCC_VERIFY", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests import their helper modules (models, multirank) and the example GPT by name.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "gpt"))

GPU_MARKERS = {"cuda": 1, "two_gpus": 2}  # marker: GPUs the test needs


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "two_gpus: needs two CUDA GPUs (skipped with fewer)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        for marker, needed in GPU_MARKERS.items():
            if item.get_closest_marker(marker) is not None and gpus < needed:
                reason = f"needs {needed} CUDA GPU(s); this machine has {gpus}"
                item.add_marker(pytest.mark.skip(reason=reason))
