"""`cpn systemd install`: the services of an installed cpn (cpn.systemd)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from cpn import systemd
from cpn.cli_base import CliParser, UsageError

__all__ = ["add_parsers", "cmd_systemd_install"]


def cmd_systemd_install(args: argparse.Namespace) -> int:
    root = Path(args.root)
    real = root.resolve() == Path("/")
    if real and os.geteuid() != 0:
        raise UsageError("installing under / needs root: run it with sudo, or pass --root DIR")
    try:
        cpn = args.cpn or systemd.cpn_command()
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if not os.access(cpn, os.X_OK):
        raise UsageError(f"--cpn {cpn}: not an executable")
    version = systemd.systemd_version()
    done = systemd.install(root=root, cpn=cpn, version=version, make_account=real)
    for path in done.written:
        print(f"wrote {path}")
    for path in done.kept:
        print(f"kept {path} (already there)")
    if done.account:
        print(f"account {done.account}: the broker runs as it")
    if version is None or version < systemd.BACKOFF_SINCE:
        print(
            f"systemd {version or 'absent'}: restarts every RestartSec, without a growing backoff"
        )
    if real:
        print(
            "next: put each site's file at /etc/cpn/sites/SITE.yaml and its options in "
            "/etc/cpn/agent-SITE.env, then `systemctl daemon-reload` and "
            "`systemctl enable --now cpn-agent@SITE` or `cpn-broker` (docs/operations.md)"
        )
    return 0


def add_parsers(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`cpn systemd install`, added with cpn.cli's `add`."""
    unit = add("systemd", help="install the agent's and the broker's systemd units")
    sub = unit.add_subparsers(dest="systemd_command", required=True, parser_class=CliParser)
    inst = sub.add_parser(
        "install",
        help="write the units to /etc/systemd/system, make /etc/cpn and the cpn account",
    )
    inst.add_argument(
        "--root", default="/", metavar="DIR", help="write under DIR instead of / (no account)"
    )
    inst.add_argument(
        "--cpn", metavar="PATH", help="the cpn command the units run (default: this one)"
    )
    inst.set_defaults(func=cmd_systemd_install)
