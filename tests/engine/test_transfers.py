"""The copy engine (zerocc/engine/transfers.py): copies cast to their destination and count
per direction; NVMe state round-trips through the rank's store; host buffers are pinned only
where a GPU takes part."""

from __future__ import annotations

import pytest
import torch

from zerocc.engine.transfers import Transfers
from zerocc.ir.ops import NVME_READ, NVME_WRITE, TO_DEVICE, TO_HOST
from zerocc.runtime.nvme import NvmeStore


def test_a_copy_casts_to_its_destination_and_counts_its_bytes():
    engine = Transfers()
    src = torch.tensor([1.5, -2.25, 3.0])
    dst = torch.empty(3, dtype=torch.bfloat16)
    engine.copy(dst, src, TO_DEVICE).wait()
    assert dst.tolist() == [1.5, -2.25, 3.0]
    engine.copy(torch.empty(3), dst, TO_HOST).wait()
    assert engine.stats.bytes == {TO_DEVICE: 6, TO_HOST: 12}  # what each destination received
    engine.stats.reset()
    assert not engine.stats.bytes


def test_nvme_state_round_trips_through_the_ranks_store(tmp_path):
    store = NvmeStore(tmp_path, rank=0)
    engine = Transfers(store)
    state = torch.randn(1000)
    engine.write("unit.exp_avg", state, NVME_WRITE).wait()
    back = torch.empty(1000)
    engine.read("unit.exp_avg", back, NVME_READ).wait()
    assert torch.equal(back, state)
    assert engine.stats.bytes == {NVME_WRITE: 4000, NVME_READ: 4000}
    store.close()


def test_reading_nvme_state_without_a_store_is_a_clear_error():
    with pytest.raises(RuntimeError, match="reads NVMe state, but no NVMe store is active"):
        Transfers().read("unit.exp_avg", torch.empty(2), NVME_READ)


def test_host_buffers_of_a_cpu_step_are_not_pinned():
    like = torch.zeros(2)
    buffer = Transfers().empty(torch.device("cpu"), (4,), torch.float32, like)
    assert buffer.shape == (4,) and not buffer.is_pinned()
