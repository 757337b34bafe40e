"""zerocc.compat: the torch APIs that changed across the supported releases resolve on each
(older names where the newer are missing), and zerocc's collectives use the current names
(no deprecation warning per collective)."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx.experimental.proxy_tensor as proxy_tensor

import zerocc.compat as compat
from zerocc.engine.comm import TorchComm


@pytest.fixture
def reload_compat(monkeypatch):
    """Reload zerocc.compat after the test's monkeypatches, and again once they are undone."""
    yield lambda: importlib.reload(compat)
    monkeypatch.undo()
    importlib.reload(compat)


def test_collectives_fall_back_to_the_names_of_older_releases(monkeypatch, reload_compat):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    reload_compat()
    assert compat.all_gather_single is dist.all_gather_into_tensor
    assert compat.reduce_scatter_single is dist.reduce_scatter_tensor


def test_proxy_mode_falls_back_to_the_name_of_older_releases(monkeypatch, reload_compat):
    monkeypatch.delattr(proxy_tensor, "get_proxy_mode", raising=False)
    reload_compat()
    assert compat.get_proxy_mode is proxy_tensor.get_innermost_proxy_mode


@pytest.fixture
def group_of_one():
    """The default process group, gloo, of this process alone; destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        compat.let_gloo_workers_finish()


def test_torch_comm_collectives_run_without_deprecation_warnings(group_of_one):
    comm = TorchComm(group_of_one)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated collective warns on every call
        shard = torch.arange(4.0)
        gathered = torch.empty(4)
        comm.all_gather(gathered, shard).wait()
        reduced = torch.empty(4)
        comm.reduce_scatter(reduced, shard * 2).wait()
        summed = shard.clone()
        comm.all_reduce(summed).wait()
    assert torch.equal(gathered, shard) and torch.equal(reduced, shard * 2)
    assert torch.equal(summed, shard)
