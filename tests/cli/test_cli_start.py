"""The command line answers at once (issue 80): `zerocc --version`, `--help`, every command's
and subcommand's `--help`, and a plan's own errors import no torch (seconds of the 0.3 s a
command without torch takes; `zerocc --version` took 5.4 s in a fresh clone). A deterministic
guard: which modules are imported, not how long it takes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from zerocc.cli.main import _parser

# Each command line is run by main() in one fresh interpreter, which says after each whether
# torch has been imported yet.
_PROBE = """
import contextlib, io, json, sys
from zerocc.cli.main import main
said = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exc:  # (argparse's --help and --version)
            status = exc.code
    said.append([argv, status, "torch" in sys.modules])
print(json.dumps(said))
"""


def _commands() -> list[list[str]]:
    """Every command and subcommand the parser has, as argv prefixes."""
    found = []

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.append([*prefix, name])
                    walk(sub, [*prefix, name])

    walk(_parser(), [])
    return found


def _probe(argvs: list[list[str]]) -> list[tuple[list[str], int, bool]]:
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    return [tuple(x) for x in json.loads(done.stdout)]


def test_help_and_version_import_no_torch():
    commands = _commands()
    assert ["plan", "check"] in commands and ["train"] in commands and len(commands) > 10
    argvs = [["--version"], ["--help"], *([*c, "--help"] for c in commands)]
    for argv, status, torch_imported in _probe(argvs):
        assert status == 0, argv
        assert not torch_imported, f"zerocc {' '.join(argv)} imported torch"


def test_a_plans_own_error_is_said_before_torch_is_imported(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("zero: {stage: 5}\n")
    argvs = [[command, str(bad)] for command in ("train", "inspect", "estimate", "profile")]
    argvs += [["plan", "check", str(bad)]]
    for argv, status, torch_imported in _probe(argvs):
        assert status == 2, argv  # (the plan's error)
        assert not torch_imported, f"zerocc {' '.join(argv)} imported torch before its error"
