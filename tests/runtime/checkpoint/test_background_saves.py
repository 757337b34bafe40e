"""Checkpoints written in the background (``save_async``): the checkpoint holds the state as
of the step it was taken at, although training went on while it was written; a failure is
raised where the save is waited for; a process that dies mid-write leaves the last committed
checkpoint as it was."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from models import build
from multirank import run_ranks
from parity import batch_of

import zerocc
from zerocc.errors import CheckpointError
from zerocc.runtime.checkpoint import Manifest

CASE = {"model": "gpt"}
PLAN = {
    "zero": {"stage": 3},
    "units": {"classes": ["Block"]},
    "optimizer": {"eps": 1e-3},
    "backend": {"device": "cpu", "kernels": "torch"},
}


def _losses(step, indices, rank: int = 0) -> list[float]:
    return [float(step(*batch_of(CASE, i, rank))) for i in indices]


def _digests(folder: Path) -> dict[str, list[str]]:
    manifest = Manifest.read(folder)
    return {name: [c.digest for c in e.chunks] for name, e in manifest.tensors.items()}


def test_a_background_save_holds_the_step_it_was_taken_at(tmp_path):
    """The state is copied when save_async returns: the steps run while the thread writes
    change the step's state, not the checkpoint, which holds the bytes a synchronous save of
    that step holds; resumed from it, the run is the run that never stopped."""
    straight = zerocc.compile(build("gpt"), PLAN)
    expected = _losses(straight, range(4))[2:]

    step = zerocc.compile(build("gpt"), PLAN)
    _losses(step, range(2))
    step.save(tmp_path / "sync")
    pending = step.save_async(tmp_path / "async")
    _losses(step, [2, 3])  # the update runs while (or after) the thread writes
    assert pending.wait() == tmp_path / "async" / "step-00000002"
    assert step.wait_for_save() is None  # its outcome was given: nothing to wait for
    assert _digests(tmp_path / "async" / "step-00000002") == _digests(
        tmp_path / "sync" / "step-00000002"
    )
    assert pending.times.blocked_s > 0 and pending.times.written_s > 0

    resumed = zerocc.compile(build("gpt", seed=123), PLAN)
    resumed.load(tmp_path / "async")
    assert _losses(resumed, [2, 3]) == expected


def test_the_next_save_waits_for_the_one_in_flight_and_keep_applies(tmp_path):
    """One save in flight at a time: each save_async (and a synchronous save) waits for the
    previous; ``keep`` deletes the older ones as a synchronous save does."""
    step = zerocc.compile(build("gpt"), PLAN)
    for i in range(3):
        _losses(step, [i])
        step.save_async(tmp_path, keep=2)
    _losses(step, [3])
    assert step.save(tmp_path, keep=2) == tmp_path / "step-00000004"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"


def test_a_background_save_that_fails_raises_where_it_is_waited_for(tmp_path):
    """A checkpoint folder that cannot be made: save_async returns (the copy is taken), the
    thread's error is raised by wait(), naming the folder, and no checkpoint appears."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    step = zerocc.compile(build("gpt"), PLAN)
    _losses(step, [0])
    pending = step.save_async(blocker / "ckpt")
    with pytest.raises(CheckpointError, match="Not a directory.*a-file"):
        pending.wait()
    _losses(step, [1])  # training goes on; a later save to a good folder works
    assert step.save(tmp_path / "good").name == "step-00000002"


_DIES_MID_WRITE = """
import os, signal, sys
sys.path[:0] = {paths!r}
from models import build
from parity import batch_of
import zerocc
from zerocc.runtime.checkpoint import files

step = zerocc.compile(build("gpt"), {plan!r})
step(*batch_of({{"model": "gpt"}}, 0, 0))
step.save({root!r})
step(*batch_of({{"model": "gpt"}}, 1, 0))
add = files.DataWriter.add
def add_then_die(self, *args):
    chunk = add(self, *args)
    if self.bytes > 4096:  # some bytes of step 2 are on disk, not all
        os.kill(os.getpid(), signal.SIGKILL)
    return chunk
files.DataWriter.add = add_then_die
step.save_async({root!r})
step(*batch_of({{"model": "gpt"}}, 2, 0))
step.wait_for_save()
"""


def test_a_process_that_dies_mid_write_leaves_the_last_checkpoint_intact(tmp_path):
    """The process is killed (SIGKILL) while its thread writes step 2:
    ``latest`` still names step 1, which loads; step 2 is only a staging folder."""
    tests = Path(__file__).parents[2]
    script = _DIES_MID_WRITE.format(
        paths=[str(tests), str(tests.parent / "examples" / "gpt")], plan=PLAN, root=str(tmp_path)
    )
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True)
    assert done.returncode == -9, done.stderr.decode()[-2000:]  # killed by SIGKILL
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step-00000002.partial", "latest", "step-00000001",
    ]  # fmt: skip
    step = zerocc.compile(build("gpt", seed=123), PLAN)
    step.load(tmp_path)
    assert step.steps == 1


def _train_saving_in_background(rank: int, world: int, root: str) -> tuple[list, list, dict]:
    straight = zerocc.compile(build("gpt"), PLAN)
    expected = _losses(straight, range(4), rank)[2:]
    step = zerocc.compile(build("gpt"), PLAN)
    _losses(step, [0], rank)
    step.save_async(root)  # step 1 ...
    _losses(step, [1], rank)  # ... written while step 2 trains
    step.save_async(root)
    step.wait_for_save()
    resumed = zerocc.compile(build("gpt", seed=123), PLAN)
    resumed.load(root)
    meta = json.loads((Path(root) / "step-00000002" / "manifest.json").read_text())["meta"]
    return expected, _losses(resumed, [2, 3], rank), {"world": meta["world_size"]}


def test_two_ranks_save_in_background_and_resume_exactly(tmp_path):
    """On two ranks the background saves agree on their own channel while the steps'
    collectives go on: both checkpoints commit, and a resume is the straight run."""
    for expected, resumed, meta in run_ranks(
        2, _train_saving_in_background, str(tmp_path), timeout=300
    ):
        assert resumed == expected
        assert meta == {"world": 2}
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001", "step-00000002"]


def test_a_save_committed_before_a_peer_left_says_it_was_committed(tmp_path, monkeypatch, capsys):
    """Issue 77: a rank killed during a background save, after rank 0 committed it and before
    the commit's agreement: the run said the save failed, yet it was committed, `latest` named
    it and it verified. The error and rank 0's line now say it was committed, and why the
    save did not end cleanly; the checkpoint loads."""
    from zerocc.errors import RankStoppedError
    from zerocc.runtime.checkpoint import agreement
    from zerocc.runtime.checkpoint.describe import checkpoints_in, verify

    real = agreement.gathered

    def peer_gone_at_commit(comm, value, what):
        if what == "commit":  # (rank 0 committed: a peer killed meanwhile never answers)
            raise RankStoppedError("rank 0: rank 1 (pid 4242) exited. This rank gave up in the "
                                   "checkpoint's commit when the peer left")  # fmt: skip
        return real(comm, value, what)

    step = zerocc.compile(build("gpt"), PLAN)
    _losses(step, [0])
    step.save(tmp_path)
    _losses(step, [1])
    monkeypatch.setattr(agreement, "gathered", peer_gone_at_commit)
    pending = step.save_async(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        pending.wait()
    monkeypatch.undo()
    folder = tmp_path / "step-00000002"
    said = (
        f"{folder} was committed whole (latest names it; it loads), but the save did not end "
        "cleanly: rank 0: rank 1 (pid 4242) exited. This rank gave up in the checkpoint's "
        "commit when the peer left"
    )
    assert str(raised.value) == said
    assert f"zerocc: the background save of step-00000002: {said}" in capsys.readouterr().err
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    (saved,) = [s for s in checkpoints_in(tmp_path)[0] if s.latest]
    assert saved.folder == folder and verify(saved).chunks > 0
    resumed = zerocc.compile(build("gpt", seed=123), PLAN)
    resumed.load(tmp_path)
    assert resumed.steps == 2


def test_a_save_not_committed_when_a_peer_left_is_not_said_committed(tmp_path):
    """What a rank finds when the commit's agreement fails: committed only where the staging
    folder is gone, the checkpoint is there and `latest` names it."""
    from zerocc.runtime.checkpoint.save import _committed

    step = zerocc.compile(build("gpt"), PLAN)
    _losses(step, [0])
    step.save(tmp_path)
    assert _committed(tmp_path, "step-00000001")
    (tmp_path / ".step-00000001.partial").mkdir()  # (rank 0 left before its rename)
    assert not _committed(tmp_path, "step-00000001")
    assert not _committed(tmp_path, "step-00000002")
