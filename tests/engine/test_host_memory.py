"""Host memory for offload (zerocc/engine/host_memory.py): tensors of their exact size,
pinned by registering that memory (torch's pinned allocator rounds each block up to a power of two),
unregistered when the storage goes; only what a GPU copies is pinned; a copy's host result is
the same buffer every step.

This machine has no GPU: registration is replaced by a recorder (what is registered, with how
many bytes, and when it is unregistered), the CUDA call itself is test_cuda.py's."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from zerocc.compiler.state import HOST, NVME, StateSpec
from zerocc.engine import host_memory
from zerocc.engine.host_memory import HostBuffers, host_empty, state_tensor
from zerocc.ir.kinds import Role


@pytest.fixture
def registered(monkeypatch) -> dict[int, int]:
    """Pointer -> bytes of what is registered now."""
    live: dict[int, int] = {}

    def register(ptr: int, nbytes: int) -> None:
        assert ptr not in live
        live[ptr] = nbytes

    monkeypatch.setattr(host_memory, "_register", register)
    monkeypatch.setattr(host_memory, "_unregister", lambda ptr: live.pop(ptr))
    return live


def test_unpinned_host_memory_is_a_plain_tensor():
    t = host_empty((3, 5), torch.bfloat16, pinned=False)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and not t.is_pinned()


def test_pinned_memory_is_registered_at_its_size_until_its_storage_goes(registered):
    """Registered whole pages of a mapping of its own (two registrations never share a page),
    its size rounded up to a page, not to a power of two as torch's pinned allocator does."""
    n = 3 * (1 << 20) + 7
    t = host_empty((n,), torch.float32, pinned=True)
    assert t.shape == (n,) and t.is_contiguous()
    pages = -(-4 * n // mmap.PAGESIZE) * mmap.PAGESIZE
    assert registered == {t.data_ptr(): pages} and t.data_ptr() % mmap.PAGESIZE == 0
    t.fill_(2.0)
    view = t[5:9]
    del t
    gc.collect()
    assert len(registered) == 1 and view.sum().item() == 8.0  # a view keeps it registered
    del view
    gc.collect()
    assert not registered


def test_only_what_a_gpu_copies_is_pinned(registered, monkeypatch):
    monkeypatch.setattr(host_memory, "REGISTER_BYTES", 0)
    cuda = torch.device("cuda", 0)
    master = StateSpec("u.master", Role.MASTER, "u", (1000,), torch.float32, HOST)
    moment = StateSpec("u.exp_avg", Role.OPTIM_STATE, "u", (1000,), torch.float32, HOST)
    on_nvme = StateSpec("u.exp_avg_sq", Role.OPTIM_STATE, "u", (1000,), torch.float32, NVME)
    tensors = [state_tensor(spec, cuda) for spec in (master, moment, on_nvme)]
    assert list(registered.values()) == [mmap.PAGESIZE]  # the master alone (4000 bytes)
    assert all(t.device.type == "cpu" and t.shape == (1000,) for t in tensors)
    assert not state_tensor(master, torch.device("cpu")).is_pinned()  # no GPU: nothing pinned
    assert len(registered) == 1


def test_a_copys_host_buffer_is_the_same_every_step():
    buffers = HostBuffers(pinned=False)
    first = buffers.get("copy_start_3", (10,), torch.float32)
    assert buffers.get("copy_start_3", (10,), torch.float32) is first
    assert buffers.get("copy_start_4", (10,), torch.float32) is not first
    other = buffers.get("copy_start_3", (12,), torch.float32)  # another shape: a new buffer
    assert other.shape == (12,) and buffers.nbytes == 4 * (10 + 12)
    other.untyped_storage().resize_(0)  # the program freed it
    again = buffers.get("copy_start_3", (12,), torch.float32)
    assert again.untyped_storage().nbytes() == 48
