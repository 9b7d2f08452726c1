"""cpn.cli's table of commands: a command's run builds (and imports) its group alone."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from cpn import cli
from tests.conftest import REPO


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return dict(sub.choices)


def test_the_table_names_every_command_of_every_group_and_no_other() -> None:
    found: dict[str, str] = {}
    for module, adder, extra in cli.GROUPS:
        parser = cli.CliParser(prog="cpn")
        sub = parser.add_subparsers(dest="command", parser_class=cli.CliParser)
        getattr(importlib.import_module(f"cpn.{module}"), adder)(sub.add_parser, *extra)
        for name in sub.choices:
            assert name not in found, f"{name} is defined by {found[name]} and {module}"
            found[name] = module
    assert cli.COMMANDS == found


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_a_commands_own_parser_holds_its_group_alone(command: str) -> None:
    group = cli.COMMANDS[command]
    choices = _choices(cli.build_parser(command))
    assert command in choices
    assert set(choices) == {c for c, g in cli.COMMANDS.items() if g == group}
    # the whole parser has every command, and the delegated ones
    assert set(_choices(cli.build_parser())) == {*cli.COMMANDS, "plan", "simulate", "plan-capacity"}


@pytest.mark.parametrize(
    "argv",
    [
        ["jobs"],
        ["-v", "describe", "j-1"],
        ["-v", "-v", "logs", "j-1", "--follow"],
        ["data", "ls"],
        ["sites", "-o", "json"],
        ["token", "create", "--role", "tenant-user", "--tenant", "t"],
        ["whoami"],
    ],
)
def test_a_command_parses_the_same_with_its_group_alone(argv: list[str]) -> None:
    command = next(a for a in argv if not a.startswith("-"))
    alone = vars(cli.build_parser(command).parse_args(argv))
    whole = vars(cli.build_parser().parse_args(argv))
    assert alone == whole


def test_an_unknown_command_is_refused_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["no-such-command"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("cpn: error: argument command: invalid choice: 'no-such-command'")
    assert "submit" in err and err.count("\n") == 1


@pytest.mark.e2e  # a fresh interpreter
def test_running_a_command_imports_its_group_alone() -> None:
    probe = (
        "import sys; from cpn import cli; cli.build_parser('jobs'); "
        "print(sorted(m for m in sys.modules if m.startswith('cpn.') and m.endswith('_cli')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['cpn.job_cli']"
