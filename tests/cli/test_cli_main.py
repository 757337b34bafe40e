"""The `zerocc` command's entry (zerocc/cli/main.py): the parser, the dispatch and the errors.
Every command is registered by its own module's ``add_commands`` (issue 78: `train`, `profile`
and `export` were registered inline in main.py, the others in their modules)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from zerocc.cli import main as cli

CLI = Path(cli.__file__).parent


def calls_to(path: Path, method: str) -> list[int]:
    """The lines of ``path`` that call ``.method(...)``."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
    ]


def commands_of(add_commands) -> set[str]:
    """The commands one ``add_commands`` registers, on a parser of their own."""
    commands = argparse.ArgumentParser().add_subparsers()
    add_commands(commands)
    return set(commands.choices)


def test_main_registers_no_command_of_its_own():
    lines = calls_to(CLI / "main.py", "add_parser")
    assert not lines, (
        f"zerocc/cli/main.py registers a command itself (lines {lines}): a command's parser is "
        "its own module's, registered by that module's add_commands(commands) in main.COMMANDS"
    )


def test_every_module_that_registers_commands_does_so_by_add_commands_in_main():
    registered = {f.__module__ for f in cli.COMMANDS}
    assert all(f.__name__ == "add_commands" for f in cli.COMMANDS)
    registering = {
        f"zerocc.cli.{path.stem}" for path in CLI.glob("*.py") if calls_to(path, "add_parser")
    }
    missing = sorted(registering - registered)
    assert not missing, f"{missing} register commands but are not in zerocc.cli.main.COMMANDS"


def test_the_parser_is_the_commands_modules_register():
    parser = cli._parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    by_module = [commands_of(add_commands) for add_commands in cli.COMMANDS]
    assert set(subparsers.choices) == set().union(*by_module)
    assert sum(len(names) for names in by_module) == len(subparsers.choices)  # (each once)
    assert {"train", "profile", "export"} <= set(subparsers.choices)
