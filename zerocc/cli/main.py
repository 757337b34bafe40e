"""The `zerocc` command: check a plan, print its schema, train a plan's workload on local ranks,
calibrate the cost model on them (`zerocc.inspect.calibrate`), inspect what the compiler built and
estimate what it costs (`zerocc.cli.inspect`).

`zerocc train PLAN --nproc N` (and `zerocc profile`) launches N local ranks with torch's own
launcher (`torch.distributed.run`, what `torchrun` runs); each rank re-enters this module with
`ZEROCC_RANK_WORKER=1` set and runs `_train_rank` (`profile_rank`). Under an outside `torchrun`
the command is already a rank and does not launch again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from zerocc.cli.inspect import add_commands as add_inspect_commands
from zerocc.compiler.plan import Plan, load_plan, plan_json_schema
from zerocc.errors import ZeroccError
from zerocc.ir.printing import human_bytes
from zerocc.runtime.launch import RANK_WORKER_ENV, report


def main(argv: list[str] | None = None) -> int:
    """Run the zerocc command line; returns the exit status (2 for a zerocc error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        (getattr(args, "help_of", None) or parser).print_help()
        return 0
    try:
        return args.run(args)
    except ZeroccError as exc:
        where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
        print(f"zerocc: {where}error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerocc", description="A compiler for sharded data-parallel training (ZeRO 0-3)."
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    plan = commands.add_parser("plan", help="check a plan file or print the plan schema")
    plan.set_defaults(help_of=plan)
    plan_commands = plan.add_subparsers(title="commands", metavar="COMMAND")
    check = plan_commands.add_parser("check", help="validate a plan file and summarize it")
    check.add_argument("plan", metavar="PLAN", help="path of a plan YAML file")
    check.set_defaults(run=_plan_check)
    schema = plan_commands.add_parser("schema", help="print the JSON Schema of plan files")
    schema.set_defaults(run=_plan_schema)

    train = commands.add_parser("train", help="train the plan's workload on local ranks")
    train.add_argument("plan", metavar="PLAN", help="path of a plan YAML file")
    train.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    train.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    train.add_argument(
        "--master-port", type=int, default=0, help="rendezvous port (default 0: a free port)"
    )
    train.add_argument(
        "--dump",
        metavar="DIR",
        help="write per-pass programs, the measured trace, memory plots and report.html to DIR",
    )
    train.set_defaults(run=_train)

    profile = commands.add_parser(
        "profile", help="measure this machine and fit the cost model's rates (a calibration)"
    )
    profile.add_argument("plan", metavar="PLAN", help="path of a plan YAML file")
    profile.add_argument(
        "-o", "--output", metavar="FILE",
        help="calibration JSON to write (default: <plan>.calibration.json next to the plan)",
    )  # fmt: skip
    profile.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    profile.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    profile.add_argument(
        "--master-port", type=int, default=0, help="rendezvous port (default 0: a free port)"
    )
    profile.set_defaults(run=_profile)
    add_inspect_commands(commands)
    return parser


def _plan_check(args: argparse.Namespace) -> int:
    plan = _checked_plan(args.plan)
    print(f"{args.plan}: ok ({describe_plan(plan)})")
    return 0


def _checked_plan(path: str) -> Plan:
    """The plan, loaded and checked where it can be before any model is built: its `passes`
    against the passes' contracts, its backend among the registered ones, and on this machine
    an NVMe offload folder must exist and take files."""
    from zerocc.backends import get_backend
    from zerocc.compiler.pass_manager import check_passes

    plan = load_plan(path)
    check_passes(plan)
    get_backend(plan.backend.name)
    if plan.offload.uses_nvme:
        from zerocc.runtime.nvme import check_folder

        check_folder(Path(plan.offload.nvme_path))
    return plan


def _plan_schema(args: argparse.Namespace) -> int:
    print(json.dumps(plan_json_schema(), indent=2))
    return 0


def describe_plan(plan: Plan) -> str:
    """A one-line summary of a plan: stage, passes, units, optimizer, workload."""
    from zerocc.compiler.pass_manager import pipeline_names

    passes = pipeline_names(plan)
    units = [f"class {c}" for c in plan.units.classes]
    units += [f"modules {m}" for m in plan.units.modules]
    if plan.units.min_mb is not None:
        units.append(f">= {plan.units.min_mb} MB")
    opt = plan.optimizer
    parts = [
        f"stage {plan.zero.stage}",
        f"{len(passes)} passes ({' -> '.join(passes)})" if passes else "no passes",
        f"units: {', '.join(units) or 'whole model'}",
        _describe_precision(plan),
        f"{opt.name} lr {opt.lr:g}" + (f" clip {opt.grad_clip:g}" if opt.grad_clip else ""),
        f"workload {plan.workload or 'none'}",
    ]
    return ", ".join(parts)


def _describe_precision(plan: Plan) -> str:
    p = plan.precision
    if not p.mixed:
        return "fp32"
    scaling = "no loss scaling" if p.scaling == "none" else f"{p.scaling} loss scaling"
    return f"{p.param} compute, {p.reduce} reduce, {p.master} master, {scaling}"


# --- train ----------------------------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    plan = _checked_plan(args.plan)  # check the plan once, before any rank starts
    if args.nproc < 1 or args.steps < 1:
        raise ZeroccError("--nproc and --steps must be at least 1")
    if args.dump:  # every rank reads it (inherited by the launched ranks)
        from zerocc.inspect.dumps import DUMP_DIR_ENV

        os.environ[DUMP_DIR_ENV] = str(Path(args.dump).resolve())
    if _launched() or args.nproc == 1:
        return _train_rank(plan, args.steps)
    return _launch(plan, args, ["train", str(args.plan), "--steps", str(args.steps)])


def _launched() -> bool:
    """Whether this process is already a rank (launched by zerocc or an outside torchrun)."""
    return RANK_WORKER_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _launch(plan: Plan, args: argparse.Namespace, command: list[str]) -> int:
    """Start `args.nproc` local ranks, each running `zerocc COMMAND...` as a rank, once the
    machine has a device for every one of them (one error here, not one per rank)."""
    from zerocc.runtime.devices import rank_device
    from zerocc.runtime.launch import launch

    rank_device(plan, local_rank=0, local_ranks=args.nproc)
    return launch(args.nproc, args.master_port or _free_port(), command)


# --- profile ----------------------------------------------------------------------------------


def _profile(args: argparse.Namespace) -> int:
    """`zerocc profile`: launch the plan's ranks (as `train` does) to calibrate the cost model."""
    from zerocc.cli.profile import profile_rank
    from zerocc.inspect.calibrate import default_output

    plan = _checked_plan(args.plan)  # as `train`: checked once, before any rank starts
    if args.nproc < 1 or args.steps < 1:
        raise ZeroccError("--nproc and --steps must be at least 1")
    output = Path(args.output or default_output(args.plan))  # the ranks share this cwd
    if _launched() or args.nproc == 1:
        return profile_rank(plan, output, args.steps)
    command = ["profile", str(args.plan), "-o", str(output), "--steps", str(args.steps)]
    return _launch(plan, args, command)


def _train_rank(plan: Plan, steps: int) -> int:
    """One rank: join the process group (when launched), compile the workload, run `steps`.
    What the launcher should know (the predicted peak, the error that ends the rank and the
    peers it found silent) goes to the rank's report (`zerocc.runtime.launch.report`)."""
    from zerocc.runtime.rank import joined_group

    with joined_group(plan) as (rank, world_size):
        try:
            return _train_steps(plan, steps, rank, world_size)
        except BaseException as exc:
            silent = [vars(p) for p in getattr(exc, "silent", [])]
            report(error=f"{type(exc).__name__}: {exc}".splitlines()[0], silent=silent)
            raise


def _train_steps(plan: Plan, steps: int, rank: int, world_size: int) -> int:
    from tqdm import tqdm

    import zerocc
    from zerocc.compiler.workload import load_workload
    from zerocc.cost.memory import model_state_bytes_of, predict_memory
    from zerocc.runtime.rank import to_device

    workload = load_workload(plan)
    step = zerocc.compile(workload.model, plan, loss_fn=workload.loss_fn)
    device = step.device  # this rank's: cuda:LOCAL_RANK or cpu
    batches = iter(workload.batches(rank, world_size))

    def next_batch() -> tuple | None:
        """This rank's next batch; None once every rank has run out at this step (a rank
        that runs out while others go on stops them all: DataExhaustedError)."""
        batch = next(batches, None)
        if batch is None:
            step.end_of_data()
        return batch

    first = next_batch()
    if first is None:
        raise ZeroccError(f"{plan.workload}: batches({rank}, {world_size}) yielded no batch")
    started = time.perf_counter()
    losses = [float(step(*to_device(first, device)))]  # captures and compiles
    first_done = time.perf_counter()
    timeline = predict_memory(step.program, model_state_bytes_of(step.layout))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    report(predicted_peak_bytes=timeline.peak()[1] + timeline.host_peak, local_ranks=local_ranks)
    if rank == 0:
        print(step.explain(), flush=True)  # explains the program the first step built
    with tqdm(total=steps, initial=1, desc="train", unit="step", disable=rank != 0) as progress:
        progress.set_postfix(loss=f"{losses[-1]:.4f}")
        while len(losses) < steps and (batch := next_batch()) is not None:
            losses.append(float(step(*to_device(batch, device))))
            progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            progress.update()
    if rank == 0:
        if len(losses) < steps:
            print(f"the data ran out on every rank after {len(losses)} step(s)")
        _print_summary(step.summary(), losses, started, first_done, world_size)
        if step.dump_dir is not None:
            print(f"dumps: {step.dump_dir} (open {step.dump_dir / 'report.html'})")
            if not shutil.which("dot"):
                from zerocc.inspect.dot import GRAPHVIZ_HINT

                print(f"  {GRAPHVIZ_HINT}")
    return 0


def _print_summary(
    summary: dict[str, Any], losses: list[float], started: float, first_done: float, world: int
) -> None:
    later = len(losses) - 1  # the first step also captured and compiled: timed apart
    first = f"the first step took {first_done - started:.2f} s, capture included"
    if later:
        first = f"{later / (time.perf_counter() - first_done):.2f} steps/s after it; " + first
    comm = summary.get("comm_bytes_per_step", {})
    comm_text = ", ".join(f"{kind} {human_bytes(n)}" for kind, n in comm.items()) or "none"
    print(
        f"\n{len(losses)} step(s) on {world} rank(s): {first}\n"
        f"final loss (rank 0): {losses[-1]:.4f}\n"
        f"communication per step: {comm_text}\n"
        f"model state per rank: {human_bytes(summary.get('model_state_bytes', 0))}"
    )
    offload = summary.get("offload_bytes_per_step")
    if offload:
        moved = ", ".join(f"{kind} {human_bytes(n)}" for kind, n in sorted(offload.items()))
        print(f"offload traffic per step: {moved}")
    if summary.get("loss_scale") is not None:
        print(
            f"loss scale: {summary['loss_scale']:g}, "
            f"{summary['skipped_steps']} step(s) skipped for overflow"
        )
    elif summary.get("skipped_steps"):
        print(f"{summary['skipped_steps']} step(s) skipped for a non-finite gradient")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
