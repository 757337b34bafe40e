"""`zerocc checkpoint PATH [--verify]`: the checkpoints of a folder and what one holds (its
step, the ranks and stage that saved it, the model, optimizer and plan), and with
``--verify`` whether every byte is as the save wrote it, before a run (or `zerocc export`)
relies on it."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerocc.errors import CheckpointError
from zerocc.ir.printing import human_bytes


def add_checkpoint_command(commands: argparse._SubParsersAction) -> None:
    """`zerocc checkpoint PATH` and its flag."""
    shown = commands.add_parser(
        "checkpoint",
        help="list a folder's checkpoints and say what one holds (--verify: read every byte "
        "against its digest)",
    )
    shown.add_argument(
        "path", metavar="PATH",
        help="a checkpoint (step-N), or a folder of them (the one a resume would load: its "
        "latest, else its newest)",
    )  # fmt: skip
    shown.add_argument(
        "--verify", action="store_true",
        help="read every chunk of the checkpoint's files and check it against its digest, as "
        "a load would (exit 2 naming the first file and tensor that differs)",
    )  # fmt: skip
    shown.set_defaults(run=_checkpoint)


def _checkpoint(args: argparse.Namespace) -> int:
    from zerocc.runtime.checkpoint.describe import checkpoints_in, details, summary_line, verify
    from zerocc.runtime.checkpoint.files import resolve

    found, other = checkpoints_in(Path(args.path))
    if len(found) > 1 or other:
        print(f"{args.path}: {len(found)} checkpoint(s)")
        for line in [*map(summary_line, found), *other]:
            print(f"  {line}")
    if not found:
        raise CheckpointError(f"{args.path}: holds no complete checkpoint")
    folder = resolve(args.path)
    saved = next((s for s in found if s.folder == folder), None)
    if saved is None:  # (`latest` names one whose manifest is there but unreadable)
        raise CheckpointError(f"{folder}, the checkpoint a resume would load, cannot be read")
    print("\n".join(details(saved)))
    if args.verify:
        read = verify(saved)
        print(f"verified: {read.chunks} chunks of {read.tensors} tensors "
              f"({human_bytes(read.nbytes)}), each as its digest says, every tensor "
              "whole")  # fmt: skip
    return 0
