"""`cpn systemd install`: the services of an installed cpn (cpn.systemd); `cpn dashboards
export DIR`: the Grafana dashboards of its metrics (metering.grafana, docs/dashboards.md)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

from cpn import systemd
from cpn.cli_base import CliParser, UsageError
from metering import grafana

__all__ = ["add_parsers", "cmd_dashboards_export", "cmd_systemd_install"]


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


def cmd_dashboards_export(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: not a directory")
    out.mkdir(parents=True, exist_ok=True)
    for uid, board in grafana.dashboards().items():
        path = out / f"{uid}.json"
        path.write_text(json.dumps(board, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {path} ({board['title']}, {len(board['panels'])} panels)")
    return 0


def add_parsers(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`cpn systemd install` and `cpn dashboards export`, added with cpn.cli's `add`."""
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

    boards = add("dashboards", help="the Grafana dashboards of cpn's metrics")
    boards_sub = boards.add_subparsers(
        dest="dashboards_command", required=True, parser_class=CliParser
    )
    export = boards_sub.add_parser(
        "export", help="write each dashboard as DIR/<uid>.json (Grafana's JSON model)"
    )
    export.add_argument("dir", metavar="DIR", help="where to write them (made if missing)")
    export.set_defaults(func=cmd_dashboards_export)
