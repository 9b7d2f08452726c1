"""The `cpn` command line.

User errors exit 2 with one line on stderr (`cpn: error: ...`); an unreachable registry or
another run-time failure exits 1. `-o json` prints machine-readable output.

The commands are in one module per group, each with its `add_parsers` (cpn/<group>_cli.py: up,
site, certs, serve, job, token, usage, tenant, service, load, backup); what they share is in
cpn.cli_base. Here: the parser that gathers them, the commands with their own parser
(`_DELEGATED`, imported by name when run), and `main`, which maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from cpn.certs import PkiError
from cpn.cli_base import CliParser, UsageError, broker_arg, etcd_arg
from cpn.client import ApiError
from cpn.config import ConfigFileError
from cpn.sdk.connection import NoBroker
from cpn.sdk.errors import ApiError as SdkApiError
from cpn.sdk.errors import ConfigError as SdkConfigError
from cpn.sdk.errors import CpnError, Invalid
from sites.model.catalog import CatalogError
from sites.model.errors import AgentConflict, ConfigError, NotJoined, RegistryError, SitesError
from sites.model.schema import SchemaTooNew

__all__ = ["CliParser", "UsageError", "build_parser", "main"]

log = logging.getLogger("cpn")


# -- commands with their own parser ----------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulations.cli import simulate_main

    return simulate_main(args.rest)


def cmd_plan_capacity(args: argparse.Namespace) -> int:
    from simulations.cli import plan_capacity_main

    return plan_capacity_main(args.rest)


def cmd_plan(args: argparse.Namespace) -> int:
    from broker.plan.cli import main as plan_main

    return plan_main(args.rest)


# -- parser --------------------------------------------------------------------------------


# The command groups, in the order `cpn --help` lists them: (module in cpn, its function that
# adds the group's parsers, what that function takes besides add_parser).
GROUPS: tuple[tuple[str, str, tuple[Callable[..., Any], ...]], ...] = (
    ("up_cli", "add_parsers", (etcd_arg,)),
    ("site_cli", "add_parsers", (etcd_arg,)),
    ("certs_cli", "add_parsers", ()),
    ("serve_cli", "add_parsers", (etcd_arg,)),
    ("job_cli", "add_parsers", (broker_arg,)),
    ("data_cli", "add_parsers", (broker_arg,)),
    ("token_cli", "add_parsers", (broker_arg,)),
    ("usage_cli", "add_parsers", (broker_arg,)),
    ("tenant_cli", "add_parsers", (broker_arg,)),
    ("service_cli", "add_parsers", (broker_arg,)),
    ("load_cli", "add_parsers", (broker_arg,)),
    ("backup_cli", "add_parsers", (etcd_arg,)),
    ("ops_cli", "add_parsers", ()),
    ("token_cli", "add_whoami", (broker_arg,)),
    ("version_cli", "add_parsers", ()),
)
# command (or alias) -> its group's module: a command's run imports its group alone (every
# group's imports together took about half a second of each `cpn` process's start).
# tests/cpn/test_cli_commands.py keeps it equal to what the groups define.
COMMANDS: dict[str, str] = {
    "up": "up_cli", "sites": "site_cli", "site": "site_cli", "certs": "certs_cli",
    "etcd": "certs_cli", "agent": "serve_cli", "broker": "serve_cli", "submit": "job_cli",
    "jobs": "job_cli", "describe": "job_cli", "workflow": "job_cli", "cancel": "job_cli",
    "suspend": "job_cli", "resume": "job_cli", "logs": "job_cli", "data": "data_cli",
    "token": "token_cli", "audit": "token_cli", "usage": "usage_cli", "alerts": "usage_cli",
    "tenants": "tenant_cli", "tenant": "tenant_cli", "services": "service_cli",
    "service": "service_cli", "load": "load_cli", "whoami": "token_cli",
    "backup": "backup_cli", "restore": "backup_cli", "recovery": "backup_cli",
    "systemd": "ops_cli", "dashboards": "ops_cli",
    "version": "version_cli",
}  # fmt: skip


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with a known `command`, only its group's parsers (its module alone
    imported)."""
    parser = CliParser(prog="cpn", description="cross-region computing-power network")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    only = COMMANDS.get(command) if command is not None else None
    for module, adder, extra in GROUPS:
        if only is None or module == only:
            getattr(importlib.import_module(f"cpn.{module}"), adder)(sub.add_parser, *extra)
    if only is not None:
        return parser

    plan = sub.add_parser(
        "plan", help="solve a placement problem offline (docs/placement.md)", add_help=False
    )
    plan.add_argument("rest", nargs=argparse.REMAINDER)
    plan.set_defaults(func=cmd_plan)
    simulate = sub.add_parser(
        "simulate", help="capacity-planning simulation (docs/simulation.md)", add_help=False
    )
    simulate.add_argument("rest", nargs=argparse.REMAINDER)
    simulate.set_defaults(func=cmd_simulate)
    capacity = sub.add_parser(
        "plan-capacity",
        help="cheapest purchases that meet simulated targets (docs/simulation.md)",
        add_help=False,
    )
    capacity.add_argument("rest", nargs=argparse.REMAINDER)
    capacity.set_defaults(func=cmd_plan_capacity)
    return parser


# commands with their own parser: everything after the name is theirs, `--help` included
# (argparse's REMAINDER does not take an option that comes first)
_DELEGATED = {
    "plan": ("broker.plan.cli", "main"),
    "simulate": ("simulations.cli", "simulate_main"),
    "plan-capacity": ("simulations.cli", "plan_capacity_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _DELEGATED:
        module, name = _DELEGATED[argv[0]]
        command = getattr(importlib.import_module(module), name)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return int(command(argv[1:]))
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        result = args.func(args)
        if isinstance(result, Coroutine):
            result = _run(result)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return int(result)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"cpn: error: {problem}", file=sys.stderr)
        return 2
    except ApiError as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 2 if 400 <= exc.status < 500 else 1
    except CpnError as exc:  # the SDK's (cpn.sdk.errors): the commands that ask through it
        print(f"cpn: error: {exc}", file=sys.stderr)
        return sdk_exit_code(exc)
    except (
        UsageError,
        ConfigFileError,
        CatalogError,
        NotJoined,
        AgentConflict,
        SchemaTooNew,
        PkiError,
        ValueError,
    ) as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `cpn jobs | head`: the reader has what it wanted; nothing more to say, no traceback
        # when the interpreter flushes stdout on its way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (RegistryError, SitesError, OSError) as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def sdk_exit_code(exc: CpnError) -> int:
    """2 for what the user can fix (a refused request, a bad value or config file), else 1
    (an unreachable broker or a failing one, as cpn.client's errors; no broker configured at
    all is 1 too, as it was before the job commands used the SDK)."""
    if isinstance(exc, Invalid):
        return 2
    if isinstance(exc, SdkApiError):
        return 2 if 400 <= exc.status < 500 else 1
    if isinstance(exc, SdkConfigError) and not isinstance(exc, NoBroker):
        return 2
    return 1


def _run(coro: Coroutine[Any, Any, int]) -> int:
    async def main() -> int:
        # `kill -USR1 PID` prints every task's stack: what a stuck process is waiting for
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)
        return await coro

    try:  # uvloop where present: the broker's proxy and API get ~2x the requests per core
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        awaitable: Any = task.get_coro()
        while awaitable is not None:  # follow the await chain down to what blocks
            frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
            if frame is None:
                print(f"    {awaitable!r}", file=sys.stderr)
                break
            print(
                f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}",
                file=sys.stderr,
            )
            awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    sys.stderr.flush()
