"""`zerocc inspect` and `zerocc estimate`: what the compiler built, and what it will cost.

Both compile the plan's workload for ``--world-size`` simulated ranks (nothing is launched and
no weight is allocated; see :mod:`zerocc.inspect.estimate`).
"""

from __future__ import annotations

import argparse

from zerocc.cli.plan_args import add_plan_arguments, plan_of


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``inspect`` and ``estimate`` on the ``zerocc`` command's subparsers."""
    inspect = commands.add_parser(
        "inspect", help="show what each pass inserted (no ranks are launched)"
    )
    add_plan_arguments(inspect)
    _world_size(inspect)
    shown = inspect.add_mutually_exclusive_group()
    shown.add_argument("--print-after", metavar="PASS", help="the program after PASS (or 'all')")
    shown.add_argument("--print-before", metavar="PASS", help="the program before PASS")
    shown.add_argument("--diff", metavar="PASS", help="what PASS changed, as a unified diff")
    shown.add_argument(
        "--schedule",
        action="store_true",
        help="a pipeline plan: only its schedule, each rank's actions in order, and its bubble",
    )
    inspect.add_argument(
        "--format", choices=("py", "dot", "json"), default="py", help="how to print a program"
    )
    inspect.add_argument("--unit", metavar="NAME", help="only the nodes of FSDP unit NAME")
    inspect.add_argument(
        "--lowered",
        nargs="?",
        const="",
        metavar="DIR",
        help="lower the program with the plan's backend and say what it made of it (Inductor: "
        "each region, its compile time); with DIR, write what it generated there",
    )
    # (--lowered may have started Inductor's worker processes, which a normal exit shuts down)
    inspect.set_defaults(run=_run_inspect, only_reports=lambda args: args.lowered is None)

    est = commands.add_parser(
        "estimate", help="per-rank memory and communication per step, for any world size"
    )
    add_plan_arguments(est)
    _world_size(est)
    est.add_argument("--table", action="store_true", help="ZeRO stages 0-3 side by side")
    est.add_argument("--json", action="store_true", help="print the figures as JSON")
    est.add_argument(
        "--link-gbps", type=float, metavar="G",
        help="per-rank interconnect bandwidth in Gbit/s (overrides plan.cost.link_gbps)",
    )  # fmt: skip
    est.add_argument(
        "--latency-us", type=float, metavar="US",
        help="collective latency per hop in microseconds (overrides plan.cost.latency_us)",
    )  # fmt: skip
    est.add_argument(
        "--calibration", metavar="FILE",
        help="rates measured by `zerocc profile` (overrides plan.cost.calibration)",
    )  # fmt: skip
    est.add_argument(
        "--device", choices=("cpu", "cuda"),
        help="whose built-in rates fill what no calibration or plan gives (default: the "
        "plan's backend.device; auto: this machine's)",
    )  # fmt: skip
    est.set_defaults(run=_run_estimate, only_reports=lambda args: True)


def _world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks to simulate (default: the plan's zero.world_size, else the fewest ranks "
        "its layout takes, 2 or more)",
    )


# (the plan is loaded before the report's modules, and torch, are imported: its errors at once)


def _run_inspect(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    from zerocc.cli.inspect_report import run_inspect

    return run_inspect(args, plan)


def _run_estimate(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    from zerocc.cli.inspect_report import run_estimate

    return run_estimate(args, plan)
