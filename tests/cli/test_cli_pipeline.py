"""`zerocc train` of a pipeline (examples/gpt/zero3-pp.yaml): it trains, says what each stage
holds, how long rank 0 waited and what it predicted (what `zerocc estimate` predicts), and
saves a checkpoint that a run with no pipeline resumes. (That the pipeline trains as one
process does: tests/parity/test_pipeline_parity.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from train_runs import CPU_ONLY

EXAMPLES = Path(__file__).parents[2] / "examples" / "gpt"


def _train(plan: str, *flags: str, nproc: int) -> str:
    command = [
        sys.executable, "-m", "zerocc", "train", str(EXAMPLES / plan), "--nproc", str(nproc),
        *flags,
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CPU_ONLY)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def _run(*args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "zerocc", *args], capture_output=True, text=True,
                         timeout=600, env=CPU_ONLY)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_zerocc_train_runs_a_pipeline_and_a_run_without_one_resumes_it(tmp_path):
    saves, dumps = tmp_path / "ckpt", tmp_path / "dumps"
    out = _train("zero3-pp.yaml", "--steps", "4", "--save", str(saves), "--dump", str(dumps),
                 nproc=4)  # fmt: skip
    assert "pipeline rank 0 of 2 (stages [0] of 2), data rank 0 of 2" in out
    assert "tied transformer.wte.weight: held by stages [0, 1]" in out
    trained = re.search(r"memory of this rank: predicted peak (\S+) at 0B0", out).group(1)
    assert re.search(r"pipeline: rank 0 waited \d+\.\d% of the last step", out)
    assert "send 256.0KiB" in out  # 4 micro-batches × [2, 64, 128] fp32, one way
    assert f"checkpoint: {saves / 'step-00000004'}" in out
    assert "checkpoints: 1 saved in the background" in out  # (a pipeline's save_async)
    # what `zerocc estimate` predicts for rank 0 is what rank 0 compiled and walked
    plan = str(EXAMPLES / "zero3-pp.yaml")
    estimated = _run("estimate", plan, "--world-size", "4")
    states = r"rank 0 \(stages \[0\]\): model states \S+, peak "
    assert re.search(states + re.escape(f"{trained} "), estimated)
    _check_dumps(dumps)
    resumed = _train("zero3.yaml", "--steps", "6", "--resume", str(saves), nproc=2)
    assert "note: saved under parallel.pp: 2, resharded for 1" in resumed
    assert "2 step(s) on 2 rank(s)" in resumed  # (the numbers: test_pipeline_checkpoint_parity)


def _check_dumps(dumps: Path) -> None:
    """What `--dump` wrote of the pipeline (pp 2 × dp 2, 1F1B over 4 micro-batches): each
    pipeline rank's programs after each pass, and the second step of every rank drawn beside
    the predicted schedule, with bubbles."""
    for program in ("rank0-stage0-F", "rank0-stage0-B", "rank1-stage1-B", "rank1-update"):
        assert sorted((dumps / "programs" / program).glob("*-shard.py")), program
    events = json.loads((dumps / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[2] == "rank 2 (pipeline rank 1, stages [1])"
    assert names[1001] == "pipeline rank 1 (predicted)"
    slices = [e for e in events if e["ph"] == "X"]
    for pid in (0, 1, 2, 3, 1000, 1001):  # 4 forwards and 4 backwards each, then the update
        actions = sorted(e["name"] for e in slices if e["pid"] == pid and "stage" in e["args"])
        stage = 0 if pid in (0, 1, 1000) else 1
        assert actions == sorted(f"{k}{m} stage {stage}" for k in "FB" for m in range(4))
        assert [e for e in slices if e["pid"] == pid and e["name"] == "update"]
    # The last stage waits for the first's activations; 1F1B's predicted warm-up is idle
    assert any(e["name"] == "bubble: waiting for stage 0" for e in slices if e["pid"] == 2)
    assert any(e["name"] == "bubble" for e in slices if e["pid"] == 1001)
    report = (dumps / "report.html").read_text()
    assert "Bubbles" in report and "step 2 as each rank ran it" in report
    assert "programs/rank1-stage1-F/" in report
