"""Where a `zerocc train` run's ranks run, and how it restarts: the machines it spans
(``--nnodes``, ``--node-rank``), where they meet (``--rdzv-*``, and `zerocc rendezvous`, a
meeting place no training machine holds), the restarts (``--max-restarts``, ``--nproc-min``)
and the ranks a machine launches when ``--nproc`` gives none; each flag checked against the
others and the plan before any rank starts."""

from __future__ import annotations

import argparse
import os

from zerocc.compiler.plan import Plan
from zerocc.errors import PlanError, ZeroccError
from zerocc.runtime.launch import launched
from zerocc.runtime.nodes import Nodes
from zerocc.runtime.rendezvous_secret import shared_secret


def add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    """`zerocc train`'s flags for the machines, their meeting and the restarts."""
    parser.add_argument(
        "--nnodes", action=_NodeCount, default=1, metavar="N|MIN:N",
        help="machines the run spans: start `zerocc train` on each, with the same plan, "
        "--nproc, --nnodes and --rdzv-endpoint (checkpoint folders must be shared); MIN:N, "
        "with --max-restarts: a machine lost and not replaced, the run goes on with fewer, "
        "down to MIN, from the last checkpoint or step in memory (resharded)",
    )  # fmt: skip
    parser.add_argument(
        "--node-rank", type=int, metavar="I",
        help="this machine's place among --nnodes, 0 to N-1 (default: $SLURM_PROCID under "
        "srun with one task per machine, else 0)",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="where the machines meet: node 0's address and a free port on it (or a "
        "`zerocc rendezvous`'s, with --rdzv-standalone); its store listens on every address, "
        "unauthenticated: set the run's shared secret in $ZEROCC_RDZV_SECRET (or a file's "
        "name in $ZEROCC_RDZV_SECRET_FILE) on every machine, and a launcher without it is "
        "refused before it joins (docs/gpus.md)",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv-standalone", action="store_true",
        help="with --nnodes and --max-restarts: --rdzv-endpoint is a `zerocc rendezvous` on a "
        "machine of its own, which no node holds, so node 0 can be lost and replaced too",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv-id", metavar="NAME",
        help="with --nnodes and --max-restarts, the run's name at the rendezvous, the same on "
        "every machine (default zerocc-PORT; Slurm: $SLURM_JOB_ID): runs that share a `zerocc "
        "rendezvous` at once need names of their own",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv-conf", metavar="KEY=VALUE,...",
        help="with --nnodes and --max-restarts, settings of torchrun's c10d rendezvous, e.g. "
        "keep_alive_interval=2,keep_alive_max_attempt=3 to count a lost machine as lost "
        "after 6 s instead of 15",
    )  # fmt: skip
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="when a rank dies, start every rank again from the last checkpoint, up to N "
        "times (needs --save; saves every --save-every steps bound the steps lost); with "
        "--nnodes, a launcher started on another machine with the same flags replaces a lost "
        "one (torchrun's c10d rendezvous; node 0 must stay up, unless --rdzv-standalone)",
    )  # fmt: skip
    parser.add_argument(
        "--nproc-min", type=int, metavar="M",
        help="when ranks still fail after --max-restarts, go on with fewer, down to M, from "
        "the last checkpoint or step in memory (resharded on load; one machine only)",
    )  # fmt: skip
    parser.set_defaults(nnodes_min=None)


class _NodeCount(argparse.Action):
    """``--nnodes N`` or ``MIN:N`` (torchrun's form): ``args.nnodes`` is N, the most machines,
    and ``args.nnodes_min`` MIN (N where none is given)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        least, _, most = value.rpartition(":")
        if not most.isdigit() or not (least or most).isdigit():
            parser.error(f"argument --nnodes: {value!r}: N or MIN:N, whole numbers")
        namespace.nnodes, namespace.nnodes_min = int(most), int(least or most)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`zerocc rendezvous` and its options."""
    from zerocc.runtime.rendezvous import DEFAULT_PORT

    meet = commands.add_parser(
        "rendezvous",
        help="keep the store where a restarting run's machines meet, on a machine of its own "
        "(`zerocc train --rdzv-standalone`): no training machine holds it, so any can be lost",
    )
    meet.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"port to listen on, every address of this machine (default {DEFAULT_PORT}); "
        "with $ZEROCC_RDZV_SECRET (or $ZEROCC_RDZV_SECRET_FILE) set, a node that has not the "
        "same secret is refused before it joins",
    )  # fmt: skip
    meet.set_defaults(run=_rendezvous)


def _rendezvous(args: argparse.Namespace) -> int:
    from zerocc.runtime.rendezvous import serve

    if not 0 < args.port < 65536:
        raise ZeroccError(f"--port {args.port}: from 1 to 65535")
    serve(args.port)
    return 0


def check_fewer_nodes(plan: Plan, nodes: Nodes, nproc: int) -> None:
    """``--nnodes MIN:N``: the plan must take every world of MIN to N machines' ranks, since
    the run goes on with any of them."""
    if nodes.fewest == nodes.count:
        return
    flag = f"--nnodes {nodes.fewest}:{nodes.count}"
    if plan.zero.world_size is not None:
        raise ZeroccError(
            f"{flag}: zero.world_size: {plan.zero.world_size} fixes the ranks; leave it out to "
            "let the run go on with fewer machines"
        )
    for machines in range(nodes.fewest, nodes.count):
        try:
            plan.check_world_size(machines * nproc)
        except PlanError as exc:
            raise ZeroccError(
                f"{flag}: on {machines} machine(s) the run would have {machines * nproc} ranks, "
                f"which the plan's layout cannot take: {exc}"
            ) from None


def fewer_ranks(plan: Plan, args: argparse.Namespace) -> int | None:
    """The most ranks below ``--nproc`` and at least ``--nproc-min`` the plan's layout takes,
    to go on with once ranks failed for good; None when there is none (or no --nproc-min)."""
    if args.nproc_min is None or plan.zero.world_size is not None:
        return None
    for fewer in range(args.nproc - 1, max(args.nproc_min, 1) - 1, -1):
        try:
            plan.check_world_size(fewer)
        except PlanError:
            continue
        return fewer
    return None


def restarts_of(args: argparse.Namespace, plan: Plan) -> int:
    """``--max-restarts``, checked: a restart resumes from the plan's checkpoint folder."""
    if args.max_restarts < 0:
        raise ZeroccError(f"--max-restarts {args.max_restarts}: 0 or more")
    if args.max_restarts and plan.checkpoint.dir is None:
        raise ZeroccError(
            f"--max-restarts {args.max_restarts} needs a checkpoint folder (--save DIR, plan: "
            "checkpoint.dir): restarted ranks resume from its newest checkpoint"
        )
    if args.nproc_min is not None:
        if not args.max_restarts:
            raise ZeroccError("--nproc-min goes with --max-restarts (and a checkpoint folder)")
        if args.nnodes > 1:
            raise ZeroccError("--nproc-min: one machine only (with --nnodes, restart the nodes)")
        if not 1 <= args.nproc_min <= args.nproc:
            raise ZeroccError(f"--nproc-min {args.nproc_min}: from 1 to --nproc ({args.nproc})")
        if plan.zero.world_size is not None:
            raise ZeroccError(
                f"--nproc-min: zero.world_size: {plan.zero.world_size} fixes the ranks; leave "
                "it out to let the run go on with fewer"
            )
    if plan.checkpoint.in_memory and not launched():
        if not args.max_restarts:
            raise ZeroccError(
                "checkpoint.in_memory: the saves to memory serve a restart: it goes with "
                "--max-restarts"
            )
    elif args.max_restarts and not plan.checkpoint.every and not launched():
        print("zerocc: note: --max-restarts without --save-every: a restart resumes from the "
              "start of the run (or --resume's checkpoint)", flush=True)  # fmt: skip
    return args.max_restarts


def nodes_of(args: argparse.Namespace) -> Nodes:
    """The machines the run spans (``--nnodes``, ``--node-rank``) and where they meet
    (``--rdzv-endpoint``, ``--rdzv-conf``, ``--rdzv-standalone``, ``--rdzv-id``; the shared
    secret, read from the environment, checked to be had)."""
    if args.nnodes > 1 and args.master_port:
        raise ZeroccError(
            "--master-port is for one machine; with --nnodes the port is --rdzv-endpoint's"
        )
    restarting = args.nnodes > 1 and args.max_restarts
    fewest = args.nnodes if args.nnodes_min is None else args.nnodes_min
    if fewest < args.nnodes and not restarting:
        raise ZeroccError(
            f"--nnodes {fewest}:{args.nnodes} goes on with fewer machines after a restart: it "
            "goes with --max-restarts (and a checkpoint folder, which reshards)"
        )
    given = {
        "--rdzv-conf": args.rdzv_conf is not None,
        "--rdzv-standalone": args.rdzv_standalone,
        "--rdzv-id": args.rdzv_id is not None,
    }
    needless = [flag for flag, set_ in given.items() if set_ and not restarting]
    if needless:
        raise ZeroccError(
            f"{needless[0]} sets the rendezvous of a run that restarts over machines (--nnodes N "
            "with --max-restarts); this run meets at a fixed address"
        )
    if args.nnodes > 1:
        shared_secret()  # (a secret file that cannot be read: said now, not after the preflight)
    return Nodes(
        args.nnodes,
        _node_rank(args),
        args.rdzv_endpoint,
        args.rdzv_conf,
        standalone=args.rdzv_standalone,
        name=args.rdzv_id,
        least=fewest,
    )


def _node_rank(args: argparse.Namespace) -> int:
    """``--node-rank``; where none is given, Slurm's task number under `srun` with one task
    per machine (``$SLURM_NTASKS`` equal to ``--nnodes``), else 0."""
    if args.node_rank is not None:
        return args.node_rank
    task, tasks = os.environ.get("SLURM_PROCID"), os.environ.get("SLURM_NTASKS")
    if args.nnodes > 1 and task is not None and tasks == str(args.nnodes) and task.isdigit():
        return int(task)
    return 0


def ranks_the_plan_takes(plan: Plan, nodes: int = 1) -> int:
    """`--nproc` when the command gives none: the fewest ranks the plan's layout takes (on
    each of ``nodes`` machines, which must divide it), said when more than 2; more than this
    machine's cores times 8 is an error asking for --nproc (a layout written for a cluster,
    launched here by mistake)."""
    least = plan.least_world_size()
    if nodes > 1:
        if least % nodes:
            raise ZeroccError(
                f"the plan's layout takes {least} ranks, which {nodes} machines cannot share "
                "evenly: pass --nproc, the ranks each machine runs"
            )
        return least // nodes
    cores = os.cpu_count() or 1
    if least > 8 * cores:
        raise ZeroccError(
            f"the plan's layout takes {least} ranks (zero.world_size, parallel, zero.replicate), "
            f"more than this machine's {cores} cores can run; pass --nproc {least} to launch "
            "them here anyway, or `zerocc estimate` the plan"
        )
    if least > 2 and not launched():
        print(f"zerocc: launching {least} ranks, the fewest the plan's layout takes", flush=True)
    return least
