"""`zerocc checkpoint PATH [--verify] [--plan PLAN]`: the checkpoints of a folder and what one
holds (its step, the ranks and stage that saved it, the model, optimizer and plan); with
``--verify`` whether every byte is as the save wrote it, and with ``--plan`` whether a run of
that plan resumes from it and what it does otherwise, before a run (or `zerocc export`)
relies on it. Also the check `zerocc train --resume` makes before it launches any rank."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from zerocc.errors import CheckpointError, PlanError
from zerocc.ir.quantities import human_bytes

if TYPE_CHECKING:
    from torch import nn

    from zerocc.compiler.plan import Plan
    from zerocc.runtime.checkpoint.files import Manifest


def add_commands(commands: argparse._SubParsersAction) -> None:
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
    shown.add_argument(
        "--plan", metavar="PLAN",
        help="say whether a run of this plan resumes from the checkpoint (its model and "
        "optimizer), and what it does otherwise than the run that saved it",
    )  # fmt: skip
    shown.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="with --plan: set a field of it (repeatable), as `zerocc train --set`",
    )  # fmt: skip
    shown.add_argument(
        "--world-size", type=int, metavar="N",
        help="with --plan: the ranks the run would have (default: the plan's zero.world_size, "
        "else the checkpoint's)",
    )  # fmt: skip
    shown.add_argument(
        "--json", action="store_true",
        help="print it all as one JSON object (checkpoints, the one shown, what --verify read, "
        "what --plan would do), for scripts",
    )  # fmt: skip
    shown.set_defaults(run=_checkpoint, backend=None, data=None)


def check_resumable(plan: Plan, model: nn.Module, path: str | Path, named_by: str) -> Manifest:
    """The checkpoint ``path`` names, whose manifest is returned, is there and of ``model``
    and ``plan``'s optimizer, as every rank's load would find after its compile; else a
    CheckpointError naming ``named_by`` (the flag that names it) and the checkpoint."""
    from zerocc.compiler.capture import describe_model
    from zerocc.runtime.checkpoint.files import Manifest, resolve
    from zerocc.runtime.checkpoint.load import check_compatible

    folder = resolve(path)
    manifest = Manifest.read(folder)
    try:
        check_compatible(describe_model(model), plan.optimizer, manifest)
    except CheckpointError as exc:
        raise CheckpointError(f"{named_by} {folder}: {exc}") from None
    return manifest


def prepare_save_folder(plan: Plan, overwrite: bool, named_by: str) -> None:
    """Before a run starts: the folder it saves to (``plan.checkpoint.dir``, named by the
    flag or field ``named_by``) holds no checkpoint of another run, nor one later than the one
    it resumes from there; with ``overwrite`` those are deleted, said on a line. Else a
    CheckpointError naming them (see :mod:`zerocc.runtime.checkpoint.save_folder`)."""
    from zerocc.runtime.checkpoint.save_folder import (
        mixed_checkpoints,
        refusal,
        replace_checkpoints,
    )

    mixed = mixed_checkpoints(plan.checkpoint.dir, plan.checkpoint.resume)
    if mixed is None:
        return
    if not overwrite:
        raise refusal(mixed, named_by)
    replace_checkpoints(mixed)
    whose = "another run's" if mixed.resumed is None else f"later than {mixed.resumed.name}"
    print(f"zerocc: --overwrite: deleted {mixed.said()} from {mixed.root} ({whose})",
          flush=True)  # fmt: skip


def _checkpoint(args: argparse.Namespace) -> int:
    from zerocc.runtime.checkpoint.describe import (
        checkpoints_in,
        details,
        record,
        summary_line,
        verify,
    )
    from zerocc.runtime.checkpoint.files import resolve

    if args.plan is None and (args.overrides or args.world_size is not None):
        raise CheckpointError("--set and --world-size go with --plan (the run they describe)")
    found, other = checkpoints_in(Path(args.path))
    lines = []
    if len(found) > 1 or other:
        lines.append(f"{args.path}: {len(found)} checkpoint(s)")
        lines += [f"  {line}" for line in [*map(summary_line, found), *other]]
    if not found:
        print("\n".join(lines))
        raise CheckpointError(f"{args.path}: holds no complete checkpoint")
    try:
        folder = resolve(args.path)
    except CheckpointError:  # (`latest` names one that is not there: the list says so too)
        print("\n".join(lines))
        raise
    saved = next((s for s in found if s.folder == folder), None)
    if saved is None:  # (`latest` names one whose manifest is there but unreadable)
        print("\n".join(lines))
        raise CheckpointError(f"{folder}, the checkpoint a resume would load, cannot be read")
    said = {"checkpoints": [record(s) for s in found], "other": other, "shown": str(folder)}
    lines += details(saved)
    if args.verify:
        read = verify(saved)
        said["verified"] = {"chunks": read.chunks, "tensors": read.tensors, "bytes": read.nbytes}
        lines.append(f"verified: {read.chunks} chunks of {read.tensors} tensors "
                     f"({human_bytes(read.nbytes)}), each as its digest says, every tensor "
                     "whole")  # fmt: skip
    if args.plan is not None:
        world, notes = _resumed_by(args, saved.folder)
        said["resumes"] = {"plan": args.plan, "world_size": world, "notes": notes}
        goes_on = ", and goes on as the run that saved it would" if not notes else "; then:"
        lines.append(f"{args.plan} on {world} rank(s) resumes from it (its model and "
                     f"optimizer){goes_on}")  # fmt: skip
        lines += [f"  note: {note}" for note in notes]
    print(json.dumps(said, indent=1) if args.json else "\n".join(lines))
    return 0


def _resumed_by(args: argparse.Namespace, folder: Path) -> tuple[int, list[str]]:
    """Whether a run of ``args.plan`` on ``args.world_size`` ranks resumes from the checkpoint
    ``folder`` (an error says why not): its world size, and the notes on what it does
    otherwise than the run that saved it."""
    from zerocc.cli.plan import checked_model, checked_plan
    from zerocc.runtime.checkpoint.load import resume_notes

    plan = checked_plan(args)
    model, _ = checked_model(plan)
    meta = check_resumable(plan, model, folder, "--plan").meta
    world = args.world_size
    if world is None:
        world = plan.zero.world_size or meta["world_size"]
    if world < 1:
        raise PlanError(f"--world-size {world}: at least 1")
    if plan.zero.world_size not in (None, world):
        raise PlanError(f"--world-size {world}: the plan's zero.world_size is "
                        f"{plan.zero.world_size}")  # fmt: skip
    plan.check_world_size(world)  # (PlanError where the plan's layout does not take it)
    return world, resume_notes(plan, world, meta)
