"""``zerocc profile PLAN``: the command (its options; the launcher's side, as ``zerocc train``'s)
and one rank's part, run under the launcher. Its rank 0 writes the calibration that
``zerocc estimate --calibration`` and a plan's ``cost.calibration`` read."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerocc.cli.machines import ranks_the_plan_takes
from zerocc.cli.plan import checked_plan
from zerocc.cli.plan_args import add_plan_arguments, forwarded
from zerocc.cli.train_command import NPROC_HELP, launch_ranks
from zerocc.compiler.plan import Plan
from zerocc.errors import ZeroccError
from zerocc.runtime.launch import launched


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`zerocc profile PLAN` and its options."""
    profile = commands.add_parser(
        "profile", help="measure this machine and fit the cost model's rates (a calibration)"
    )
    add_plan_arguments(profile)
    profile.add_argument(
        "-o", "--output", metavar="FILE",
        help="calibration JSON to write (default: <plan>.calibration.json next to the plan)",
    )  # fmt: skip
    profile.add_argument("--nproc", type=int, help=NPROC_HELP)
    profile.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    profile.add_argument(
        "--master-port", type=int, default=0, help="rendezvous port (default 0: a free port)"
    )
    profile.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    """`zerocc profile`: launch the plan's ranks (as `train` does) to calibrate the cost model."""
    plan = checked_plan(args)  # as `train`: checked once, before any rank starts
    from zerocc.inspect.calibrate import default_output

    args.nproc = args.nproc or ranks_the_plan_takes(plan)
    if args.nproc < 1 or args.steps < 1:
        raise ZeroccError("--nproc and --steps must be at least 1")
    output = Path(args.output or default_output(args.plan))  # the ranks share this cwd
    if launched() or args.nproc == 1:
        return profile_rank(plan, output, args.steps)
    command = ["profile", str(args.plan), "-o", str(output), "--steps", str(args.steps),
               *forwarded(args)]  # fmt: skip
    return launch_ranks(plan, args, command).status


def profile_rank(plan: Plan, output: Path, steps: int) -> int:
    """One rank of ``zerocc profile``: join the group, compile, calibrate; rank 0 writes."""
    import zerocc
    from zerocc.compiler.workload import load_workload
    from zerocc.inspect.calibrate import calibrate
    from zerocc.runtime.rank import first_batch, joined_group, to_device

    with joined_group(plan) as (rank, world_size):
        workload = load_workload(plan)
        step = zerocc.compile(workload.model, plan, loss_fn=workload.loss_fn)
        data_rank, data_ranks = step.data_rank, step.data_parallel  # one batch per tp group
        batches = workload.batches(data_rank, data_ranks)
        first = first_batch(batches, plan, data_rank, data_ranks)
        step(*to_device(first, step.device))  # captures and compiles
        endless = _endless(batches, workload, data_rank, data_ranks)
        result = calibrate(step, endless, steps=steps)
        if rank == 0:
            output.parent.mkdir(parents=True, exist_ok=True)
            result.save(output)
            print(result.table())
            print(f"wrote {output}; use it with `zerocc estimate PLAN --calibration {output}` "
                  f"or `cost: {{calibration: {output.name}}}` in a plan next to it")  # fmt: skip
    return 0


def _endless(batches: Iterator, workload: Any, rank: int, world_size: int) -> Iterator:
    """The workload's batches, started again whenever they run out."""
    from zerocc.compiler.workload import workload_code

    fresh = False
    while True:
        count = 0
        with workload_code(f"batches({rank}, {world_size})"):
            for count, batch in enumerate(batches, 1):  # noqa: B007 (count is read below)
                yield batch
        if fresh and count == 0:
            raise RuntimeError(f"batches({rank}, {world_size}) yielded no batch")
        batches, fresh = workload.batches(rank, world_size), True
