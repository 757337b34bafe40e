"""What an in-memory snapshot (``checkpoint.in_memory``) costs a step: writing a rank's state
into /dev/shm as zerocc's snapshot file (raw bytes copied into the file's pages) against
``torch.save`` of the same tensors to the same place, and reading it back.

The state: ``--gib`` GiB of fp32 in ``--tensors`` tensors, in this process (one rank's);
``--repeat`` interleaved writes of each, wall and CPU seconds, medians. Each write replaces
the last file: into a new file's pages, as a rank's first snapshots are written, and into the
pages of a file kept mapped from an earlier write, as a rank's later ones are (its spare).

    python bench/snapshot_write.py                 # 1 GiB, 6 writes each

Prints a table and writes ``bench/results/snapshot-write-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from provenance import provenance

from zerocc.runtime.checkpoint.snapshot_file import read_snapshot, write_snapshot

RESULTS = Path(__file__).parent / "results"
SHM = Path("/dev/shm")


def _timed(action) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = p.parse_args()
    each = int(args.gib * 2**30 / 4 / args.tensors)
    state = {f"rank0/unit{i}.param": torch.randn(each) for i in range(args.tensors)}
    runs: dict[str, list[tuple[float, float]]] = {
        "snapshot, new file": [], "snapshot, reused": [], "torch.save": [], "snapshot read": []
    }  # fmt: skip
    with tempfile.TemporaryDirectory(dir=SHM) as folder:
        snapshot, saved = Path(folder) / "rank.snapshot", Path(folder) / "rank.pt"
        reused = Path(folder) / "reused.snapshot"  # (its own file: a new one would replace it)
        kept = {"file": write_snapshot(reused, state, {})}

        def write_reused() -> None:  # (into the same pages each time)
            kept["file"] = write_snapshot(reused, state, {}, kept["file"])

        for _ in range(args.repeat):
            runs["snapshot, new file"].append(_timed(lambda: write_snapshot(snapshot, state, {})))
            runs["snapshot, reused"].append(_timed(write_reused))
            runs["torch.save"].append(_timed(lambda: torch.save(state, saved)))
            runs["snapshot read"].append(
                _timed(lambda: [t.sum() for t in read_snapshot(snapshot)[0].values()])
            )
    median = {
        name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
        for name, r in runs.items()
    }
    print(f"\n{args.gib:g} GiB in {args.tensors} tensors into {SHM}, median of {args.repeat}")
    print(f"{'':<20}{'wall s':>9}{'CPU s':>9}{'GB/s':>8}")
    for name, (wall, cpu) in median.items():
        print(f"{name:<20}{wall:>9.3f}{cpu:>9.3f}{args.gib * 2**30 / wall / 1e9:>8.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out / f"snapshot-write-{stamp}.json"
    report = {**provenance(), **vars(args), "out": str(args.out), "runs": runs,
              "median": median}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
