"""The plan a command reads: a file, and what the command line sets in it (``--set KEY=VALUE``,
``--backend NAME``), checked as the file's own fields are."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerocc.compiler.plan import Plan, load_plan


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``PLAN``, ``--set KEY=VALUE`` (repeatable) and ``--backend NAME`` on ``parser``."""
    parser.add_argument("plan", metavar="PLAN", help="path of a plan YAML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="set a plan field by its dotted path, the value as YAML (repeatable): "
        "--set optimizer.lr=3e-4 --set units.classes=[Block]",
    )  # fmt: skip
    parser.add_argument(
        "--backend", metavar="NAME",
        help="the plan's backend.name: eager, inductor, inductor-whole or auto",
    )  # fmt: skip
    parser.add_argument(
        "--data", metavar="PATH",
        help="the workload's data (workload_args.data), from the current folder: the GPT "
        "example's a text file or token files (.bin, .npy, or a folder of them), the Hugging "
        "Face workloads' a text or JSONL file",
    )  # fmt: skip


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The command line's ``KEY=VALUE`` items, ``--backend`` as ``backend.name``, ``--data`` as
    ``workload_args.data`` (made absolute: a plan's own relative paths start at its folder)."""
    backend = [f"backend.name={args.backend}"] if args.backend else []
    data = getattr(args, "data", None)
    data = [f"workload_args.data={json.dumps(str(Path(data).resolve()))}"] if data else []
    return [*args.overrides, *backend, *data]


def plan_of(args: argparse.Namespace) -> Plan:
    """The command's plan: its file with the command line's fields set (PlanError naming the
    ``--set`` item, the field and what it allows)."""
    return load_plan(args.plan, overrides_of(args))


def forwarded(args: argparse.Namespace) -> list[str]:
    """The flags that give launched ranks the same plan: ``--set KEY=VALUE`` for each item."""
    return [flag for item in overrides_of(args) for flag in ("--set", item)]
