"""The comm layer (zerocc/engine/comm.py): what each collective leaves in its output,
what it counts (ZeRO's accounting: an all-gather its output, a reduce-scatter its input, an
all-reduce twice its size), the check before the first collective, and zerocc's own groups on
gloo."""

from __future__ import annotations

import pytest
import torch

from zerocc.engine.comm import CommStats, FakeComm, SoloComm


def _collectives(comm) -> dict[str, torch.Tensor]:
    world = comm.world_size
    shard = torch.arange(3, dtype=torch.float32) + 10 * comm.rank
    gathered = torch.empty(3 * world)
    comm.all_gather(gathered, shard).wait()
    full = torch.arange(2.0 * world)
    reduced = torch.empty(2)
    comm.reduce_scatter(reduced, full).wait()
    summed = torch.full((4,), float(comm.rank + 1))
    comm.all_reduce(summed).wait()
    return {"gathered": gathered, "reduced": reduced, "summed": summed}


def test_a_fake_group_acts_as_if_every_rank_held_this_ranks_data():
    comm = FakeComm(4, rank=1)
    out = _collectives(comm)
    assert out["gathered"].tolist() == [10.0, 11.0, 12.0] * 4
    assert out["reduced"].tolist() == [2.0 * 4, 3.0 * 4]  # this rank's chunk, times 4 ranks
    assert out["summed"].tolist() == [2.0 * 4] * 4
    assert comm.stats.snapshot() == {
        "calls": {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1},
        "elements": {"all_gather": 12, "reduce_scatter": 8, "all_reduce": 8},
        "bytes": {"all_gather": 48, "reduce_scatter": 32, "all_reduce": 32},
    }
    comm.stats.reset()
    assert comm.stats.snapshot()["calls"] == {}


def test_one_rank_copies_and_counts():
    comm = SoloComm()
    out = _collectives(comm)
    assert out["gathered"].tolist() == [0.0, 1.0, 2.0]
    assert out["reduced"].tolist() == [0.0, 1.0] and out["summed"].tolist() == [1.0] * 4
    assert comm.stats.calls == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}


def test_the_check_runs_once_right_before_the_first_collective():
    comm, seen = FakeComm(2), []
    with comm.checked_before_first_collective(lambda: seen.append(dict(comm.stats.calls))):
        assert seen == []  # nothing issued yet: nothing checked
        _collectives(comm)
    assert seen == [{}]  # once, before anything was counted

    def refuse():
        raise RuntimeError("ranks disagree")

    comm.stats.reset()
    with (
        pytest.raises(RuntimeError, match="disagree"),
        comm.checked_before_first_collective(refuse),
    ):
        _collectives(comm)
    assert comm.stats.calls == {}  # stopped before the collective
    _collectives(comm)  # outside the block: no check left behind


def _on_two_ranks(rank: int, world: int) -> dict:
    import gc

    from zerocc.engine.comm import TorchComm

    comm = TorchComm.create(timeout_s=60, device=torch.device("cpu"))
    out = _collectives(comm)
    objects = comm.all_gather_object({"rank": rank})
    weights = torch.full((2,), float(rank + 5))
    comm.broadcast(weights, src=0)
    group = comm.group
    comm.close()
    released = comm.group is None and group not in torch.distributed.distributed_c10d._world.pg_map
    del group
    gc.collect()
    return {**out, "objects": objects, "weights": weights, "released": released}


def test_zeroccs_own_groups_on_two_gloo_ranks():
    from multirank import run_ranks

    for rank, out in enumerate(run_ranks(2, _on_two_ranks)):
        assert out["gathered"].tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert out["reduced"].tolist() == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert out["summed"].tolist() == [3.0] * 4  # 1 + 2
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        assert out["weights"].tolist() == [5.0, 5.0]  # rank 0's
        assert out["released"]


def test_stats_paused_leave_the_figures_as_before_in_the_same_object():
    """What an evaluation moves is not the last step's: the figures come back as they were,
    in the object every group's comm shares (a new object would leave the groups counting in
    the old one)."""
    stats = CommStats()
    stats.record("all_gather", 10, 4)
    before = stats.snapshot()
    with stats.paused():
        stats.record("all_gather", 5, 4)
        stats.record("all_reduce (pp)", 1, 4)
    assert stats.snapshot() == before
    stats.record("all_reduce (pp)", 1, 4)
    assert stats.bytes["all_reduce (pp)"] == 4  # (counting goes on after)
