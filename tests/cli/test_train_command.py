"""`zerocc train`'s pre-flight (zerocc/cli/train_command.py) under a pipeline plan: the memory
check it runs for any plan before it launches a rank, on the pipeline's predicted memory."""

from __future__ import annotations

from pathlib import Path

from zerocc.runtime.launch import Launched

PIPELINE_PLAN = Path(__file__).parents[2] / "examples" / "gpt" / "zero3-pp.yaml"


def test_train_checks_a_pipelines_ranks_fit_before_launching_any(monkeypatch, capsys):
    """A pipeline plan's ranks were launched whatever their memory (the pre-flight skipped
    pp > 1) and each found it short once started; the launcher now walks each pipeline rank's
    predicted peak over its schedule (as `zerocc estimate`) against this machine first, in the
    words the ranks' own check says it, and launches nothing."""
    from zerocc.cli import main as cli
    from zerocc.cli import train_command
    from zerocc.runtime import machine_memory

    launches = []
    monkeypatch.setattr(
        train_command, "launch_ranks", lambda *args: launches.append(args) or Launched(0)
    )
    real = machine_memory.available_memory
    monkeypatch.setattr(machine_memory, "available_memory", lambda device: {"host": 2**20})
    assert cli.main(["train", str(PIPELINE_PLAN), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "this pipeline rank's stages [" in err and "] do not fit in memory (rank " in err
    assert "available: 1.0MiB" in err and "forward(s) awaiting their backward" in err, err
    assert launches == []
    monkeypatch.setattr(machine_memory, "available_memory", real)  # (this machine: it fits)
    assert cli.main(["train", str(PIPELINE_PLAN), "--nproc", "2"]) == 0
    assert len(launches) == 1
