"""`zerocc inspect` and `zerocc estimate`: what the compiler built, and what it will cost.

Both compile the plan's workload for ``--world-size`` simulated ranks (nothing is launched and
no weight is allocated; see :mod:`zerocc.inspection`).
"""

from __future__ import annotations

import argparse
import difflib
import json

from zerocc.errors import ZeroccError
from zerocc.inspection import Estimate, Inspection, estimate, inspect_plan, pass_table
from zerocc.pass_manager import PassRecord
from zerocc.plan import Plan, load_plan
from zerocc.printing import format_program, human_bytes, program_to_json


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``inspect`` and ``estimate`` on the ``zerocc`` command's subparsers."""
    inspect = commands.add_parser(
        "inspect", help="show what each pass inserted (no ranks are launched)"
    )
    inspect.add_argument("plan", metavar="PLAN", help="path of a plan YAML file")
    _world_size(inspect)
    shown = inspect.add_mutually_exclusive_group()
    shown.add_argument("--print-after", metavar="PASS", help="the program after PASS (or 'all')")
    shown.add_argument("--print-before", metavar="PASS", help="the program before PASS")
    shown.add_argument("--diff", metavar="PASS", help="what PASS changed, as a unified diff")
    inspect.add_argument(
        "--format", choices=("py", "dot", "json"), default="py", help="how to print a program"
    )
    inspect.add_argument("--unit", metavar="NAME", help="only the nodes of FSDP unit NAME")
    inspect.set_defaults(run=run_inspect)

    est = commands.add_parser(
        "estimate", help="per-rank memory and communication per step, for any world size"
    )
    est.add_argument("plan", metavar="PLAN", help="path of a plan YAML file")
    _world_size(est)
    est.add_argument("--table", action="store_true", help="ZeRO stages 0-3 side by side")
    est.add_argument("--json", action="store_true", help="print the figures as JSON")
    est.set_defaults(run=run_estimate)


def _world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks to simulate (default: the plan's zero.world_size, else 2)",
    )


def _inspection(args: argparse.Namespace, plan: Plan | None = None) -> Inspection:
    plan = plan or load_plan(args.plan)
    world_size = args.world_size or plan.zero.world_size or 2
    if world_size < 1:
        raise ZeroccError("--world-size must be at least 1")
    return inspect_plan(plan, world_size, keep_graphs=True)


# --- inspect ----------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    """``zerocc inspect``: the pass table, or one program printed, or one pass's diff."""
    inspection = _inspection(args)
    records = inspection.stepping.records
    if args.unit is not None and args.unit not in {u.name for u in inspection.units}:
        names = ", ".join(u.name for u in inspection.units)
        raise ZeroccError(f"--unit {args.unit!r}: no such unit; units: {names}")
    if args.diff:
        before, after = _around(records, args.diff)
        print(_diff(before, after, args.unit), end="")
    elif args.print_after == "all":
        for record in records:
            print(_show(record, args.format, args.unit))
    elif args.print_after or args.print_before:
        before, after = _around(records, args.print_after or args.print_before)
        print(_show(after if args.print_after else before, args.format, args.unit))
    else:
        print(_pass_table_text(inspection))
    return 0


def _around(records: list[PassRecord], name: str) -> tuple[PassRecord, PassRecord]:
    """The records before and after pass ``name`` (the first is the captured program)."""
    names = [r.name for r in records]
    if name not in names[1:]:
        raise ZeroccError(f"no pass {name!r} in this pipeline; passes: {', '.join(names[1:])}")
    i = names.index(name)
    return records[i - 1], records[i]


def _show(record: PassRecord, fmt: str, unit: str | None) -> str:
    header = record.program.splitlines()[0].removeprefix("# ")
    if fmt == "json":
        return json.dumps(program_to_json(record.gm, header, unit), indent=1)
    if fmt == "dot":
        from zerocc.dot import program_to_dot

        return program_to_dot(record.gm, header, unit)
    return format_program(record.gm, header, unit)


def _diff(before: PassRecord, after: PassRecord, unit: str | None) -> str:
    """The printed programs' unified diff, headers (which carry timings) left out."""
    old = format_program(before.gm, only_unit=unit).splitlines(keepends=True)
    new = format_program(after.gm, only_unit=unit).splitlines(keepends=True)
    return "".join(
        difflib.unified_diff(old, new, f"before {after.name}", f"after {after.name}", n=1)
    )


def _pass_table_text(inspection: Inspection) -> str:
    plan, records = inspection.plan, inspection.stepping.records
    rows = pass_table(records)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"{plan.source or 'plan'}: ZeRO stage {plan.zero.stage}, {inspection.world_size} ranks, "
        f"{len(inspection.units)} units; the program of a step that runs the optimizer",
        "",
    ]
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w) for i, (c, w) in
                 enumerate(zip(row, widths, strict=True))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --- estimate ---------------------------------------------------------------------------------


def run_estimate(args: argparse.Namespace) -> int:
    """``zerocc estimate``: per-rank memory and bytes per step, for one stage or all four."""
    plan = load_plan(args.plan)
    if args.table:
        estimates = [estimate(_inspection(args, _with_stage(plan, stage))) for stage in range(4)]
        if args.json:
            print(json.dumps([e.as_dict() for e in estimates], indent=2))
        else:
            print(_estimate_table(plan, estimates))
        return 0
    result = estimate(_inspection(args, plan))
    print(json.dumps(result.as_dict(), indent=2) if args.json else _estimate_text(plan, result))
    return 0


def _with_stage(plan: Plan, stage: int) -> Plan:
    copy = plan.model_copy(update={"zero": plan.zero.model_copy(update={"stage": stage})})
    copy._source = plan.source
    return copy


ROWS = (
    ("params", lambda e: e.model_states.get("params", 0)),
    ("grads", lambda e: e.model_states.get("grads", 0)),
    ("optimizer states", lambda e: e.model_states.get("optimizer", 0)),
    ("model states", lambda e: e.model_states["total"]),
    ("gathered units (peak)", lambda e: e.peak["gathered"]),
    ("activations (peak)", lambda e: e.peak["activations"]),
    ("peak", lambda e: e.peak["total"]),
)


def _estimate_text(plan: Plan, e: Estimate) -> str:
    p = plan.precision
    lines = [
        f"{plan.source or 'plan'}: ZeRO stage {e.stage}, {e.world_size} ranks, "
        f"compute {p.param}, reduce {p.reduce}, master {p.master}",
        "",
        "memory per rank (predicted from the scheduled program):",
    ]
    lines += [f"  {name:<24}{human_bytes(get(e)):>12}" for name, get in ROWS]
    lines += ["", "communication per optimizer step, per rank:"]
    lines += [f"  {kind:<24}{human_bytes(n):>12}" for kind, n in sorted(e.comm.items())]
    return "\n".join(lines)


def _estimate_table(plan: Plan, estimates: list[Estimate]) -> str:
    kinds = sorted({k for e in estimates for k in e.comm})
    header = f"{'per rank':<26}" + "".join(f"{'stage ' + str(e.stage):>12}" for e in estimates)
    lines = [
        f"{plan.source or 'plan'}: {estimates[0].world_size} ranks, "
        f"compute {plan.precision.param}; memory predicted from each stage's program",
        "",
        header,
        "-" * len(header),
    ]
    for name, get in ROWS:
        lines.append(f"{name:<26}" + "".join(f"{human_bytes(get(e)):>12}" for e in estimates))
    for kind in kinds:
        lines.append(
            f"{kind + ' / step':<26}"
            + "".join(f"{human_bytes(e.comm.get(kind, 0)):>12}" for e in estimates)
        )
    return "\n".join(lines)
