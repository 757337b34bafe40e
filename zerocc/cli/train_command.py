"""``zerocc train PLAN`` as a command: its options, and the launcher's side of a run. The plan
is checked once here (with the command's flags, and ``--auto``'s search), the checkpoint
folder prepared and what the ranks need checked before any starts; then the ranks are
launched, each running :func:`zerocc.cli.train.train_rank` (a rank's side of the run)."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from zerocc.cli.checkpoint import check_resumable, prepare_save_folder
from zerocc.cli.machines import (
    add_machine_arguments,
    check_fewer_nodes,
    fewer_ranks,
    nodes_of,
    ranks_the_plan_takes,
    restarts_of,
)
from zerocc.cli.plan import CUDA_MEMORY_GIB, checked_model, checked_plan, memory_per_rank
from zerocc.cli.plan_args import add_plan_arguments, forwarded
from zerocc.compiler.plan import Plan
from zerocc.errors import CheckpointError, ZeroccError
from zerocc.runtime.launch import Launched, environment, launched, memory_folder
from zerocc.runtime.nodes import Nodes

if TYPE_CHECKING:
    import torch

    from zerocc.compiler.driver.session import CompileSession


NPROC_HELP = (
    "local ranks to launch (default: the fewest the plan's layout takes, 2 or more: "
    "zero.world_size, or what parallel and zero.replicate need)"
)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`zerocc train PLAN` and its options."""
    train = commands.add_parser("train", help="train the plan's workload on local ranks")
    add_plan_arguments(train)
    train.add_argument("--nproc", type=int, help=NPROC_HELP)
    train.add_argument(
        "--steps",
        type=int,
        default=20,
        help="optimizer steps, each of grad_accumulation micro-batches (default 20)",
    )
    train.add_argument(
        "--master-port", type=int, default=0, help="rendezvous port (default 0: a free port)"
    )
    add_machine_arguments(train)
    train.add_argument(
        "--dump",
        metavar="DIR",
        help="write per-pass programs, the measured trace, memory plots and report.html to DIR",
    )
    train.add_argument(
        "--save", metavar="DIR",
        help="save checkpoints to DIR: at the end, every --save-every steps and on SIGTERM or "
        "Ctrl-C (plan: checkpoint.dir)",
    )  # fmt: skip
    train.add_argument(
        "--save-every", type=int, metavar="N",
        help="optimizer steps between saves; 0: only at the end and on SIGTERM or Ctrl-C "
        "(plan: checkpoint.every)",
    )  # fmt: skip
    train.add_argument(
        "--keep", type=int, metavar="K",
        help="newest checkpoints kept, older ones deleted (plan: checkpoint.keep, default 3)",
    )  # fmt: skip
    train.add_argument(
        "--resume", metavar="DIR",
        help="start from a checkpoint, or the newest in a folder of them (plan: "
        "checkpoint.resume); --steps counts the steps it already trained",
    )  # fmt: skip
    train.add_argument(
        "--overwrite", action="store_true",
        help="save into a --save folder that holds another run's checkpoints (or ones later "
        "than --resume's there): delete those first, saying which (without it: refused)",
    )  # fmt: skip
    train.add_argument(
        "--log-every", type=int, metavar="N",
        help="optimizer steps per metrics record (plan: metrics.every, default 1)",
    )  # fmt: skip
    train.add_argument(
        "--metrics", metavar="FILE",
        help="append a JSONL record per --log-every steps: loss (mean over ranks), lr, "
        "tokens/s, MFU and memory on GPUs (plan: metrics.file)",
    )  # fmt: skip
    train.add_argument(
        "--tensorboard", metavar="DIR",
        help="write the records to a TensorBoard log folder (needs tensorboard; plan: "
        "metrics.tensorboard)",
    )  # fmt: skip
    train.add_argument(
        "--eval-every", type=int, metavar="N",
        help="evaluate the loss on the workload's held-back data every N optimizer steps and "
        "at the end (plan: metrics.eval_every)",
    )  # fmt: skip
    train.add_argument(
        "--auto", action="store_true",
        help="first search the stages, recomputation and (cuda) offload the plan leaves open "
        "for the fastest that fits these ranks, as `zerocc plan auto` does, and train it",
    )  # fmt: skip
    train.add_argument(
        "--memory", type=float, metavar="GIB",
        help=f"with --auto: memory per rank in GiB (default: cpu, this machine's available "
        f"memory over --nproc; cuda, {CUDA_MEMORY_GIB:g}, an H100's)",
    )  # fmt: skip
    train.set_defaults(run=run_train)


# Flags of `zerocc train` that override a plan section's fields: section -> {flag: field}.
SECTION_FLAGS = {
    "checkpoint": {"save": "dir", "save_every": "every", "keep": "keep", "resume": "resume"},
    "metrics": {
        "log_every": "every",
        "metrics": "file",
        "tensorboard": "tensorboard",
        "eval_every": "eval_every",
    },
}


def _joins_a_run_under_way(nodes: Nodes, args: argparse.Namespace) -> bool:
    """Whether this launcher replaces a lost node of an elastic run still under way at a
    `zerocc rendezvous` (``--rdzv-standalone``, the one place such a run outlives node 0)."""
    from zerocc.runtime import rendezvous

    if not (nodes.standalone and nodes.count > 1 and args.max_restarts):
        return False
    host, port = nodes.address()  # (the endpoint's: a standalone run has one)
    return rendezvous.under_way(host, port, nodes.run_name(port))


def run_train(args: argparse.Namespace) -> int:
    """`zerocc train`: check the plan once, then train on this process or launch the ranks."""
    plan = _with_section_flags(checked_plan(args), args)  # checked once, here (torch after it)
    from zerocc.cli.train import train_rank
    from zerocc.inspect.dumps import DUMP_DIR_ENV

    nodes = nodes_of(args)
    args.nproc = args.nproc or ranks_the_plan_takes(plan, nodes.count)
    if args.nproc < 1 or args.steps < 1:
        raise ZeroccError("--nproc and --steps must be at least 1")
    check_fewer_nodes(plan, nodes, args.nproc)
    if args.memory is not None and not args.auto:
        raise ZeroccError("--memory goes with --auto (the memory the plan search fits)")
    if args.auto and not launched():  # (launched ranks get the choice as --set items)
        plan = _with_section_flags(_searched(plan, args, nodes), args)
    # Every rank reads the dump folder (the launched ranks inherit it); set for this command
    # only, so a later step of the same process does not dump.
    dumps = {DUMP_DIR_ENV: str(Path(args.dump).resolve())} if args.dump else {}
    # (a later node joins the run node 0 started; so does node 0's replacement, at a
    # `zerocc rendezvous` where that run is under way: its folder holds the run's own saves)
    if not launched() and nodes.rank == 0 and not _joins_a_run_under_way(nodes, args):
        prepare_save_folder(plan, args.overwrite, "--save" if args.save else "checkpoint.dir")
    with environment(dumps):
        restarts = restarts_of(args, plan)
        if launched() or (args.nproc == 1 and nodes.count == 1 and not restarts):
            return train_rank(plan, args.steps)
        _preflight(plan, args, nodes)
        command = ["train", str(args.plan), "--steps", str(args.steps), *forwarded(args)]
        for flags in SECTION_FLAGS.values():
            for flag in flags:
                if getattr(args, flag) is not None:
                    command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        with memory_folder() as memory:  # (the smaller run's ranks read the larger one's)
            ended = launch_ranks(plan, args, command, nodes, restarts, memory)
            # Fewer ranks where one was lost (killed, crashed); ranks that all raised an error
            # would meet it again.
            while ended.lost_a_rank and (fewer := fewer_ranks(plan, args)) is not None:
                newest = "newest checkpoint in " + str(plan.checkpoint.dir)
                if plan.checkpoint.in_memory:
                    newest = "newest step in memory, or the " + newest
                print(f"zerocc: ranks failed after {restarts} restart(s): going on with {fewer} "
                      f"rank(s), not {args.nproc} (--nproc-min {args.nproc_min}), from the "
                      f"{newest}", file=sys.stderr, flush=True)  # fmt: skip
                args.nproc = fewer
                resumed = [*command, "--resume", str(plan.checkpoint.dir)]  # (the last counts)
                ended = launch_ranks(plan, args, resumed, nodes, restarts, memory)
        return ended.status


def _searched(plan: Plan, args: argparse.Namespace, nodes: Nodes) -> Plan:
    """`train --auto`: the plan search for this run's ranks and device (the table printed);
    the choice is added to the command's ``--set`` items, which the launched ranks get too,
    and the plan returned with it."""
    from zerocc.cost.rates import rates_for
    from zerocc.inspect.plan_search import search_plans
    from zerocc.runtime.devices import rank_device

    device = rank_device(plan, local_rank=0, local_ranks=args.nproc)
    rates = rates_for(plan, device.type)
    memory = memory_per_rank(rates.device, args.memory, args.nproc)
    search = search_plans(plan, args.nproc * nodes.count, memory, rates, ranks_per_node=args.nproc)
    print(search.format(), flush=True)
    if search.best is None:
        raise ZeroccError("--auto: no candidate plan fits; see the table above")
    args.overrides += [f"{path}={json.dumps(v)}" for path, v in search.best.fields.items()]
    return checked_plan(args)


def _with_section_flags(plan: Plan, args: argparse.Namespace) -> Plan:
    """The plan with its `checkpoint` and `metrics` sections overridden by the command's
    flags, checked as the plan's own fields are."""
    from pydantic import ValidationError

    update = {}
    for name, flags in SECTION_FLAGS.items():
        given = {
            field: getattr(args, f) for f, field in flags.items() if getattr(args, f) is not None
        }
        if not given:
            continue
        section = getattr(plan, name)
        try:
            update[name] = type(section).model_validate(section.model_dump() | given)
        except ValidationError as exc:
            first = exc.errors()[0]
            flag = next(f for f, field in flags.items() if field == first["loc"][0])
            raise ZeroccError(f"--{flag.replace('_', '-')}: {first['msg']}") from None
    return plan.model_copy(update=update) if update else plan  # keeps the plan's source


def _preflight(plan: Plan, args: argparse.Namespace, nodes: Nodes) -> None:
    """What `train` checks once before it launches any rank, cheapest first: a device for each
    local rank, what the plan names in the model (which builds it), that the checkpoint it
    resumes from is of this model and optimizer, that the model states of this machine's
    ranks fit its memory and their GPUs' (the ranks check the step's transient memory, which
    takes a capture), and that their in-memory snapshots fit /dev/shm."""
    from zerocc.compiler.driver.session import CompileSession
    from zerocc.errors import PlanWarning
    from zerocc.runtime.devices import rank_device
    from zerocc.runtime.memory_check import check_states_before_launch

    device = rank_device(plan, local_rank=0, local_ranks=args.nproc)
    model, _ = checked_model(plan)
    if plan.checkpoint.resume is not None:
        check_resumable(plan, model, plan.checkpoint.resume, "--resume")
    if not plan.backend.check_memory:
        return
    if plan.parallel.pp > 1:  # (a pipeline's memory is its schedule's: each rank's walked)
        _check_pipeline_ranks(plan, args, nodes, device)
        return
    with warnings.catch_warnings():  # (the ranks say them, once)
        warnings.simplefilter("ignore", PlanWarning)
        session = CompileSession.open(model, plan, args.nproc * nodes.count)
    check_states_before_launch(session, plan, args.nproc, nodes.rank * args.nproc, device.type)
    if plan.checkpoint.in_memory:
        _check_snapshot_room(session, args.nproc, copies=nodes.count > 1)


def _check_pipeline_ranks(
    plan: Plan, args: argparse.Namespace, nodes: Nodes, device: torch.device
) -> None:
    """That the pipeline ranks this machine is about to start fit its memory and their GPUs':
    each one's predicted peak over its schedule (its model states, what its stages keep for
    backward, the running program: :mod:`zerocc.cost.pipeline_memory`), every pipeline rank
    compiled as `zerocc estimate` compiles it (on fake tensors), in the words its ranks would
    raise (:func:`~zerocc.runtime.memory_check.check_pipeline_memory`). The rank that needs
    the most is checked first: where the ranks share a pool (host memory), it is short
    whenever any is."""
    import torch

    from zerocc.compiler.plan.pipeline import less_gathered
    from zerocc.compiler.state import DEVICE
    from zerocc.errors import PlanWarning
    from zerocc.inspect.pipeline_estimate import estimate_pipeline
    from zerocc.runtime import machine_memory, nvml
    from zerocc.runtime.machine_memory import DEVICE_POOL, HOST_POOL
    from zerocc.runtime.memory_check import RankMemory, check_pipeline_memory, pool_of

    cuda, first = device.type == "cuda", nodes.rank * args.nproc
    free = nvml.free_bytes(list(range(args.nproc))) if cuda else {}
    if free is None:
        return  # (NVML cannot say: the ranks check it once started)
    with warnings.catch_warnings():  # (the ranks say them, once)
        warnings.simplefilter("ignore", PlanWarning)
        estimate = estimate_pipeline(plan, args.nproc * nodes.count)
    mesh, pool = estimate.inspection.mesh, pool_of(DEVICE, device)
    ranks = [estimate.ranks[mesh.pp_rank(first + r)] for r in range(args.nproc)]
    host = machine_memory.available_memory(torch.device("cpu"))[HOST_POOL]
    figures = []
    for r, rank in enumerate(ranks):
        need = {pool: rank.memory.peak}
        offloaded = rank.model_states.get("host", 0)
        if offloaded:
            need[HOST_POOL] = need.get(HOST_POOL, 0) + offloaded
        available = {HOST_POOL: host, **({DEVICE_POOL: free[r]} if cuda else {})}
        place = f"cuda:{r}" if cuda else "cpu"
        figures.append(RankMemory(first + r, socket.gethostname(), place, need, available))
    gathered = less_gathered(plan.zero.stage, plan.pipeline.gather)
    for rank in sorted(ranks, key=lambda rank: -rank.memory.peak)[:1]:
        check_pipeline_memory(
            rank.memory, {}, rank.stages, None, device, gathered,
            rank.model_states.get("host", 0), views=lambda _: figures,
        )  # fmt: skip


def _check_snapshot_room(session: CompileSession, local_ranks: int, copies: bool) -> None:
    """That ``checkpoint.in_memory``'s snapshots of this machine's ranks fit /dev/shm (a tmpfs
    written past its size kills the writer by SIGBUS); host memory the first save checks, once
    the ranks hold their states."""
    from zerocc.cost.memory import model_state_bytes_of, snapshot_bytes_of
    from zerocc.runtime.checkpoint.in_memory import check_room
    from zerocc.runtime.launch import SHARED_MEMORY

    if not SHARED_MEMORY.is_dir():
        raise CheckpointError(
            f"checkpoint.in_memory keeps its snapshots in {SHARED_MEMORY} (Linux's shared "
            "memory), which this machine has not"
        )
    snapshot = snapshot_bytes_of(model_state_bytes_of(session.layout))
    free = shutil.disk_usage(SHARED_MEMORY).free
    check_room(snapshot, local_ranks, copies, free, SHARED_MEMORY)


def launch_ranks(
    plan: Plan,
    args: argparse.Namespace,
    command: list[str],
    nodes: Nodes | None = None,
    max_restarts: int = 0,
    memory: Path | None = None,
) -> Launched:
    """Start `args.nproc` local ranks, each running `zerocc COMMAND...` as a rank, once the
    machine has a device for every one of them (one error here, not one per rank); their
    in-memory checkpoints in ``memory`` where given (see :func:`launch`)."""
    from zerocc.runtime.devices import rank_device
    from zerocc.runtime.launch import launch

    rank_device(plan, local_rank=0, local_ranks=args.nproc)
    port = args.master_port or _free_port()
    return launch(args.nproc, port, command, nodes, max_restarts, memory)


def _free_port() -> int:
    """A TCP port free on this machine now (the rendezvous's, when --master-port is 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
