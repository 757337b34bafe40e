"""An in-memory snapshot's file: every tensor back bit for bit, in its dtype and shape, as a
view of the file's pages; a file cut short is named, not read as zeros."""

from __future__ import annotations

import pytest
import torch

from zerocc.errors import CheckpointError
from zerocc.runtime.checkpoint.snapshot_file import read_snapshot, write_snapshot


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "rank0/h.0.param": torch.randn(3, 5, generator=g),
        "rank0/h.0.exp_avg": torch.randn(7, generator=g).to(torch.bfloat16),
        "rank0/optim.step": torch.tensor(12.0),  # (0-dim)
        "rank0/mask": torch.tensor([True, False, True]),
        "rank0/ids": torch.arange(5, dtype=torch.int64)[::2],  # (not contiguous)
        "rng/cpu": torch.get_rng_state(),
    }


def test_a_snapshot_reads_back_every_tensor_bit_for_bit(tmp_path):
    path = tmp_path / "step-00000003.rank-00000-of-00002.snapshot"
    written = _tensors()
    write_snapshot(path, written, {"step": 3, "zerocc": {"steps": 3, "loss_scaler": None}})
    tensors, meta = read_snapshot(path)
    assert meta == {"step": 3, "zerocc": {"steps": 3, "loss_scaler": None}}
    assert tensors.keys() == written.keys()
    for name, t in written.items():
        got = tensors[name]
        assert (got.dtype, got.shape) == (t.dtype, t.shape), name
        assert torch.equal(got, t), name
    assert not list(tmp_path.glob(".*partial"))  # (made whole by its rename)


def test_a_snapshot_cut_short_is_named(tmp_path):
    path = tmp_path / "cut.snapshot"
    write_snapshot(path, _tensors(), {})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="cut.snapshot: a snapshot cut short"):
        read_snapshot(path)
