"""Checkpoints in memory (``checkpoint.in_memory``): each rank's state after every step in its
machine's memory and a copy on the next machine, so that a lost machine's ranks are restored
from their neighbour's memory, bit for bit, wherever the restart puts them. (The restart
itself, by `zerocc train --max-restarts`, is tested in tests/cli.)"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from models import build
from multirank import run_ranks
from parity import _model, batch_of, plan_of

import zerocc
from zerocc.errors import CheckpointError
from zerocc.runtime.checkpoint.in_memory import MemoryCheckpoints, snapshot_name
from zerocc.runtime.checkpoint.snapshot_file import read_snapshot

CASE = {"model": "gpt"}
PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "backend": {"device": "cpu", "kernels": "torch"},
}
RANKS_PER_MACHINE = 2
PIPELINE = {"model": "gpt4", "accum": 4, "steps": 4, "backend": "eager", "stage": 3,
            "world": 2, "pp": 2}  # fmt: skip


def _train(step, indices, rank: int) -> list[float]:
    return [float(step(*batch_of(CASE, i, rank))) for i in indices]


def _machine_folder(root: Path, rank: int, swapped: bool) -> Path:
    machine = rank // RANKS_PER_MACHINE
    return root / f"machine-{1 - machine if swapped else machine}"


def _lose_a_machine_and_restore(rank: int, world: int, root: Path) -> dict:
    step = zerocc.compile(build("gpt"), PLAN)
    folder = _machine_folder(root, rank, swapped=False)
    memory = MemoryCheckpoints(folder, step.comm, RANKS_PER_MACHINE)
    _train(step, [0, 1], rank)
    memory.save(step)
    _train(step, [2], rank)
    memory.save(step)
    memory.wait()  # (the copies travel on a thread)
    step.comm.all_gather_object(None)  # (each rank clears the older files it looks after)
    held = sorted((h.step, h.rank) for h in memory.held())
    saved = {k: v.clone() for k, v in step.state_dict().items() if isinstance(v, torch.Tensor)}
    expected = _train(step, [3], rank)
    if rank != 3:  # the save of step 4, cut short by the loss: rank 3's snapshot never made
        (folder / snapshot_name(4, rank, world)).write_bytes(b"cut short")
    step.comm.all_gather_object(None)  # (every rank has trained on before machine 1 goes)
    if rank == 0:
        shutil.rmtree(root / "machine-1")  # machine 1 is lost, and its memory with it
    step.comm.all_gather_object(None)
    step.comm.close()

    # The restart puts ranks 0-1 on machine 1's replacement (empty), ranks 2-3 on machine 0.
    restarted = zerocc.compile(build("gpt", seed=123), PLAN)
    folder = _machine_folder(root, rank, swapped=True)
    memory = MemoryCheckpoints(folder, restarted.comm, RANKS_PER_MACHINE)
    done, _, everyone = memory.newest()
    fetched = memory.restore(restarted, done, everyone)
    state = restarted.state_dict()
    same = all(torch.equal(state[k], v) for k, v in saved.items())
    return {"held": held, "done": done, "fetched": fetched, "same": same,
            "losses": (expected, _train(restarted, [3], rank))}  # fmt: skip


def test_a_lost_machines_ranks_are_restored_from_the_next_machines_copies(tmp_path):
    """4 ranks as 2 machines of 2. After each save a machine holds its ranks' snapshots and
    the other machine's copies, of the newest step only. Machine 1 is lost; after the restart
    ranks 0-1 run on its empty replacement, ranks 2-3 on machine 0: ranks 2-3 read theirs from
    machine 0's memory, ranks 0-1 receive theirs from machine 0's ranks. Every rank's state
    is the one it saved, and the next step's loss is the uninterrupted run's, bit for bit.
    The save of the step after, cut short (rank 3's snapshot of it nowhere), is not taken."""
    results = run_ranks(4, _lose_a_machine_and_restore, tmp_path)
    for rank, result in enumerate(results):
        assert result["held"] == [(3, r) for r in range(4)], rank  # (its own and the copies)
        assert result["done"] == 3 and result["fetched"] == 2
        assert result["same"], rank
        assert result["losses"][0] == result["losses"][1], rank


def _save_three_steps(rank: int, world: int, root: Path) -> dict:
    """Two ranks, each its own machine (a folder), each keeping the other's copy: three steps
    saved, with the files' inodes after each. Each machine's folder first holds the spare the
    other rank left there before a restart renumbered the ranks."""
    step = zerocc.compile(build("gpt"), PLAN)
    folder = root / f"machine-{rank}"
    folder.mkdir(parents=True)
    (folder / f".rank-{1 - rank:05d}.own.spare").write_bytes(b"\0" * 4096)
    memory = MemoryCheckpoints(folder, step.comm, ranks_per_machine=1)
    inodes = []
    for i in range(3):
        _train(step, [i], rank)
        memory.save(step)
        memory.wait()
        files = {k: f.path for k, f in memory.newest_files.items()}
        inodes.append({k: p.stat().st_ino for k, p in files.items()})
    state = {k: v for k, v in step.state_dict().items() if isinstance(v, torch.Tensor)}
    tensors, _ = read_snapshot(folder / snapshot_name(3, rank, world))
    return {
        "inodes": inodes,
        "spares": {k: f.path.stat().st_ino for k, f in memory.spares.items()},
        "names": sorted(p.name for p in folder.iterdir()),
        "same": all(torch.equal(tensors[k], v) for k, v in state.items()),
    }


def test_a_save_writes_into_the_pages_of_the_step_before_the_last(tmp_path):
    """After each save a rank keeps its newest files mapped and the step before's as spares:
    the third step is written (and its copy received) into the first step's files, which take
    no new pages, and the folder holds the newest step's snapshots and the two spares, not
    the older steps' nor a spare of the rank that ran there before (a spare is its own rank's:
    that rank, elsewhere now, writes into new pages there). What is written reads back as the
    state saved."""
    for rank, result in enumerate(run_ranks(2, _save_three_steps, tmp_path)):
        first, second, third = result["inodes"]
        assert first.keys() == {"own", "copy"}
        assert third == first and second != first, rank
        assert result["spares"] == second, rank
        peer = 1 - rank
        assert result["names"] == sorted([
            snapshot_name(3, rank, 2), snapshot_name(3, peer, 2),
            f".rank-{rank:05d}.own.spare", f".rank-{rank:05d}.copy.spare",
        ]), rank  # fmt: skip
        assert result["same"], rank


def _save_while_the_peer_trains(rank: int, world: int, root: Path) -> dict:
    """Rank 1 saves only once rank 0's save has returned: with the copies on a thread, rank
    0's returns with rank 1's copy not yet there (a save that waited for its copies would wait
    for rank 1, which waits for it: the run would time out)."""
    step = zerocc.compile(build("gpt"), PLAN)
    folder = root / f"machine-{rank}"
    memory = MemoryCheckpoints(folder, step.comm, ranks_per_machine=1)
    _train(step, [0], rank)
    peer_copy = folder / snapshot_name(1, 1 - rank, world)
    if rank == 0:
        memory.save(step)
        before = peer_copy.exists()
        step.comm.all_gather_object(None)
    else:
        step.comm.all_gather_object(None)
        memory.save(step)
        before = None
    memory.wait()
    return {"before": before, "after": peer_copy.exists()}


def test_the_copies_travel_while_training_goes_on(tmp_path):
    first, second = run_ranks(2, _save_while_the_peer_trains, tmp_path, timeout=120)
    assert first == {"before": False, "after": True}
    assert second["after"]


def _pipeline_steps(step, indices: range) -> list[float]:
    k = PIPELINE["accum"]
    losses = []
    for s in indices:
        micro = [batch_of(PIPELINE, s * k + m, step.data_rank) for m in range(k)]
        losses.append(float(step(*(torch.cat(parts) for parts in zip(*micro, strict=True)))))
    return losses


def _restore_a_pipeline(rank: int, world: int, root: Path) -> tuple[list[float], list[float]]:
    step = zerocc.compile(_model(PIPELINE), plan_of(PIPELINE))
    memory = MemoryCheckpoints(root, step.comm, ranks_per_machine=world)
    _pipeline_steps(step, range(2))
    memory.save(step)
    expected = _pipeline_steps(step, range(2, 4))
    step.comm.close()
    # other weights (seeded by rank + 1): all of them must come from memory
    restarted = zerocc.compile(
        _model({**PIPELINE, "rank_seeds": True}, rank + 1), plan_of(PIPELINE)
    )
    memory = MemoryCheckpoints(root, restarted.comm, ranks_per_machine=world)
    done, _, everyone = memory.newest()
    assert memory.restore(restarted, done, everyone) == 0  # (one machine: each its own)
    return expected, _pipeline_steps(restarted, range(2, 4))


def test_a_pipeline_restores_from_memory_before_its_first_call(tmp_path):
    """A restart restores before the first batch, which cuts a pipeline's stages: the
    counters load then, the tensors once the stages exist, and the run goes on as the one that
    did not stop (pp 2, ZeRO-3 within each stage), bit for bit."""
    for expected, resumed in run_ranks(2, _restore_a_pipeline, tmp_path):
        assert resumed == expected


def _abandon_a_copy_whose_peer_never_answers(rank: int, world: int, root: Path) -> dict:
    step = zerocc.compile(build("gpt"), PLAN)
    memory = MemoryCheckpoints(root / f"machine-{rank}", step.comm, ranks_per_machine=1)
    _train(step, [0], rank)
    said = {}
    if rank == 0:  # (rank 1 never saves: its half of the copy never comes, its link stays up)
        memory.save(step)
        started = time.monotonic()
        memory.abandon(grace_s=0.5)
        said["abandoned_s"] = time.monotonic() - started
        step.comm.failure = RuntimeError("rank 1 stopped answering")  # (as a collective's)
        step.comm.close()  # (the side channel's exchange still pending)
        said["closed_s"] = time.monotonic() - started
        (root / "rank-0-closed").touch()
    else:
        while not (root / "rank-0-closed").exists():
            time.sleep(0.1)
        step.comm.close()
    return said


def test_a_copy_whose_peer_never_answers_is_left_on_the_way_out(tmp_path):
    """A rank whose peer stopped answering mid-copy (its connection open: gloo would wait out
    the collective timeout, 10 minutes by default) leaves the copy after its grace, and its
    groups close at once: it gets back to the launcher, which restarts the ranks."""
    first, _ = run_ranks(2, _abandon_a_copy_whose_peer_never_answers, tmp_path, timeout=120)
    assert 0.4 < first["abandoned_s"] < 5, first
    assert first["closed_s"] < 20, first


def _save_in_memory_and_on_disk(rank: int, world: int, root: Path) -> None:
    """Two ranks, each its own machine: two steps saved in memory, the second on disk too."""
    step = zerocc.compile(build("gpt"), PLAN)
    memory = MemoryCheckpoints(root / f"machine-{rank}", step.comm, ranks_per_machine=1)
    for i in range(2):
        _train(step, [i], rank)
        memory.save(step)
    memory.wait()
    step.save(root / "disk")
    step.comm.all_gather_object(None)  # (each rank cleared the older files it looks after)


def _write_out_on_one_rank(rank: int, world: int, root: Path) -> dict:
    """Machine 0 alone (machine 1 lost): its snapshots of 2 ranks written out and loaded."""
    step = zerocc.compile(build("gpt", seed=123), PLAN)
    memory = MemoryCheckpoints(root / "machine-0", step.comm, ranks_per_machine=1)
    done, taken_by, everyone = memory.newest()
    path = memory.write_out(done, taken_by, everyone, root / "written", keep=None)
    notes = step.load(path)
    from_disk = zerocc.compile(build("gpt", seed=7), PLAN)
    from_disk.load(root / "disk")
    theirs = from_disk.state_dict()
    return {
        "newest": (done, taken_by),
        "path": path,
        "notes": notes,
        "same": all(
            torch.equal(t, theirs[k])
            for k, t in step.state_dict().items()
            if isinstance(t, torch.Tensor)
        ),  # fmt: skip
        "losses": (_train(step, [2], rank), _train(from_disk, [2], rank)),
    }


def test_snapshots_of_more_ranks_are_written_out_as_a_checkpoint_that_reshards(tmp_path):
    """2 ranks, each its own machine, keep their snapshots and each other's copies; machine 1
    is lost, and the run goes on with 1 rank (``--nnodes 1:2``). Machine 0's memory holds
    every rank's state of step 2 (its own, and its copy of rank 1's), of 2 ranks: written out
    as a checkpoint it is the one the 2 ranks saved of the same step, every tensor's bytes and
    the run's metadata, and it loads on 1 rank resharded as that one does."""
    run_ranks(2, _save_in_memory_and_on_disk, tmp_path)
    shutil.rmtree(tmp_path / "machine-1")
    (result,) = run_ranks(1, _write_out_on_one_rank, tmp_path)
    assert result["newest"] == (2, 2)
    assert result["path"] == tmp_path / "written" / "step-00000002"
    written, saved = (json.loads((folder / "step-00000002" / "manifest.json").read_text())
                      for folder in (tmp_path / "written", tmp_path / "disk"))  # fmt: skip
    assert written == saved
    assert any("2 ranks" in note for note in result["notes"]), result["notes"]
    assert result["same"]
    assert result["losses"][0] == result["losses"][1]


def _write_out_a_snapshot_cut_short(rank: int, world: int, root: Path) -> str:
    step = zerocc.compile(build("gpt"), PLAN)
    memory = MemoryCheckpoints(root / "machine-0", step.comm, ranks_per_machine=1)
    done, taken_by, everyone = memory.newest()
    try:
        memory.write_out(done, taken_by, everyone, root / "written", keep=None)
    except CheckpointError as exc:
        return str(exc)
    return "written"


def test_a_snapshot_that_cannot_be_written_out_fails_the_write_out_naming_it(tmp_path):
    """A snapshot cut short fails the write-out on every rank, naming its file, and nothing
    is committed (the restart then loads the disk's newest checkpoint, and says why)."""
    run_ranks(2, _save_in_memory_and_on_disk, tmp_path)
    shutil.rmtree(tmp_path / "machine-1")
    cut = tmp_path / "machine-0" / snapshot_name(2, 1, 2)
    cut.write_bytes(cut.read_bytes()[:100])
    (said,) = run_ranks(1, _write_out_a_snapshot_cut_short, tmp_path)
    assert "write-out of the snapshots in memory failed" in said and str(cut) in said, said
    assert not (tmp_path / "written" / "step-00000002").exists()


def _save_where_memory_is_short(rank: int, world: int, root: Path) -> tuple[str, list[str]]:
    from zerocc.runtime.checkpoint import in_memory

    in_memory._room = lambda folder: 10_000  # (what each machine has: less than a snapshot)
    step = zerocc.compile(build("gpt"), PLAN)
    folder = root / f"machine-{rank}"
    memory = MemoryCheckpoints(folder, step.comm, ranks_per_machine=1)
    _train(step, [0], rank)
    try:
        memory.save(step)
        memory.wait()  # (over machines the save's agreement comes with the copies)
    except CheckpointError as exc:
        return str(exc), sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
    return "saved", []


def test_snapshots_that_would_not_fit_in_memory_are_refused_before_any_is_written(tmp_path):
    """A tmpfs written past its size kills the writer by SIGBUS (and host memory short, the
    out-of-memory killer does): the first save checks that its machine's snapshots fit before
    it writes, and every rank raises the error naming the machine, what it needs and what it
    has."""
    said = run_ranks(2, _save_where_memory_is_short, tmp_path)
    (error, written), _ = said
    assert said[0][0] == said[1][0] and written == []
    assert "checkpoint.in_memory: the snapshots " in error, error
    assert "'s 1 rank(s) keep (" in error and "and its copy of the previous machine's" in error
    assert "do not fit in its memory (9.8KiB free in" in error
    assert "turn checkpoint.in_memory off" in error


SPLIT = {  # states split otherwise than by the units' shards: a rank's slices differ
    "pipeline": PIPELINE,
    "tensor-parallel": {"model": "gpt", "stage": 3, "world": 2, "tp": 2, "backend": "eager"},
}


def _write_out_beside_a_save(rank: int, world: int, root: Path, case: dict) -> None:
    step = zerocc.compile(_model(case), plan_of(case))
    memory = MemoryCheckpoints(root / "machine", step.comm, ranks_per_machine=world)
    if "pp" in case:
        _pipeline_steps(step, range(2))
    else:
        for i in range(2):
            step(*batch_of(case, i, step.data_rank))
    memory.save(step)
    step.save(root / "disk")
    done, taken_by, everyone = memory.newest()
    memory.write_out(done, taken_by, everyone, root / "written", keep=None)


@pytest.mark.parametrize("case", SPLIT.values(), ids=SPLIT.keys())
def test_a_pipeline_or_tensor_parallel_ranks_snapshots_write_out_as_their_save(tmp_path, case):
    """A pipeline rank's snapshot holds its stages' units, a tensor-parallel rank's its rows of
    the split layers (strided runs): written out, each is the checkpoint the ranks saved."""
    run_ranks(2, _write_out_beside_a_save, tmp_path, case)
    name = "step-00000002"
    written, saved = (json.loads((tmp_path / folder / name / "manifest.json").read_text())
                      for folder in ("written", "disk"))  # fmt: skip
    assert written == saved
    strided = any(c.get("runs", 1) > 1 for t in saved["tensors"].values() for c in t["chunks"])
    assert strided == ("tp" in case)  # (a tp rank's rows of a split layer: strided runs)
