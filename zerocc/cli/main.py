"""The `zerocc` command's entry: the parser, the dispatch to the command chosen and how its
errors end the process. Each command is its own module's, registered by its ``add_commands``
(:data:`COMMANDS`): `plan` (check, auto, import, schema: `zerocc.cli.plan`), `train`
(`zerocc.cli.train_command`; a rank's side in `zerocc.cli.train`), `profile`
(`zerocc.cli.profile`), `export` (`zerocc.cli.export`), `checkpoint` (`zerocc.cli.checkpoint`),
`rendezvous` (`zerocc.cli.machines`), `inspect`, `estimate` and their kin (`zerocc.cli.inspect`).

`zerocc train PLAN --nproc N` (and `zerocc profile`) launches N local ranks with torch's own
launcher (`torch.distributed.run`, what `torchrun` runs); each rank re-enters this module with
`ZEROCC_RANK_WORKER=1` set and runs `train_rank` (`profile_rank`). Under an outside `torchrun`
the command is already a rank and does not launch again.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

from zerocc.cli import checkpoint, export, inspect, machines, plan, profile, train_command
from zerocc.errors import ZeroccError
from zerocc.runtime.launch import RANK_WORKER_ENV, launched, report

# Each command's module registers it (and its subcommands) with its ``add_commands``.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    plan.add_commands,
    train_command.add_commands,
    profile.add_commands,
    export.add_commands,
    checkpoint.add_commands,
    machines.add_commands,
    inspect.add_commands,
)


def console() -> NoReturn:
    """The ``zerocc`` executable (and ``python -m zerocc``): :func:`main` as the process's whole
    work, which then ends."""
    status = main(ends_process=True)
    if launched():
        _end_rank(status)
    raise SystemExit(status)


# Seconds a rank's exit waits on its threads before it says which it waits on.
EXIT_NOTICE_S = 30.0


def _end_rank(status: int) -> NoReturn:
    """End a rank's process once its command is done: its threads joined and its exit
    functions run, as at a normal exit, then the process ends without finalizing the
    interpreter. Its work is over by then (checkpoints committed, process groups destroyed),
    but torch's native threads can still meet the dying interpreter: a gloo worker releasing
    the tensors of a collective, another library's thread left to the end. Such a rank dies of
    SIGABRT (``terminate called without an active exception``) after every step succeeded,
    now and then (CI saw it after a restarted run's last step), and the launcher reports a
    failed run.

    The order is the interpreter's own (``Py_FinalizeEx``): ``threading._shutdown`` runs the
    threading exit hooks (a ``ThreadPoolExecutor``'s shutdown, which wakes its idle workers)
    and then joins the non-daemon threads; then the exit functions. Joining first waited
    forever on the idle workers of Inductor's compile pool, after any compile that was not a
    cache hit. A thread that keeps the exit waiting longer is named (:func:`_say_who_waits`):
    a rank that ends late does so visibly, not in silence."""
    notice = threading.Timer(EXIT_NOTICE_S, _say_who_waits)
    notice.daemon = True
    notice.start()
    threading._shutdown()  # type: ignore[attr-defined]
    notice.cancel()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _say_who_waits() -> None:
    """Name the threads a rank's exit still waits on, on stderr."""
    main = threading.main_thread()
    waited = [t.name for t in threading.enumerate() if t is not main and not t.daemon]
    rank = f"rank {os.environ['RANK']}" if "RANK" in os.environ else "this rank"
    print(f"zerocc: {rank} is done and has waited {EXIT_NOTICE_S:g} s for its threads to "
          f"end: {', '.join(waited) or 'none left'} (the run ends when they do)",
          file=sys.stderr, flush=True)  # fmt: skip


def main(argv: list[str] | None = None, *, ends_process: bool = False) -> int:
    """Run the zerocc command line; returns the exit status (2 for a zerocc error).
    ``ends_process``: nothing runs after it in this process, so a command that only reports
    (``inspect``, ``estimate``) ends the process as soon as its report is out, without tearing
    down what it built: freeing a 7.5B model's compiled programs object by object took ~0.9 s
    of CPU, a tenth of the command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        (getattr(args, "help_of", None) or parser).print_help()
        return 0
    try:
        status = args.run(args)
        if ends_process and getattr(args, "only_reports", lambda _: False)(args):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    except ZeroccError as exc:
        if os.environ.get(RANK_WORKER_ENV):  # zerocc's launcher prints it, once for the ranks
            report(error=f"{type(exc).__name__}: {exc}".splitlines()[0], message=str(exc))
        else:
            where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
            print(f"zerocc: {where}error: {exc}", file=sys.stderr)
        return 2
    except Exception:
        if not launched():
            raise
        # A launched rank ends with exit code 1. Raised out of the module, the traceback would
        # keep the rank's objects alive into the interpreter's exit, where a C++ thread left to
        # the end aborts the process now and then ("terminate called without an active
        # exception"): the rank then died of SIGABRT, not of its error. Under zerocc's launcher
        # the traceback goes to the rank's report, and the launcher prints the first failed
        # rank's once (every rank's, all alike, was one per rank); under another launcher the
        # rank prints it.
        if os.environ.get(RANK_WORKER_ENV):
            report(traceback=traceback.format_exc())
        else:
            traceback.print_exc()
    gc.collect()  # the error's frames, while the interpreter still runs
    return 1


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    from zerocc import __version__

    parser = argparse.ArgumentParser(
        prog="zerocc", description="A compiler for sharded data-parallel training (ZeRO 0-3)."
    )
    python = sys.version.split()[0]
    parser.add_argument(
        "--version", action="version",
        version=f"zerocc {__version__} (torch {version('torch')}, Python {python})",
    )  # fmt: skip
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    for add_commands in COMMANDS:  # (in the order `zerocc --help` lists them)
        add_commands(commands)
    return parser
