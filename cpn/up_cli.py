"""`cpn up`: a demo federation on this machine (etcd, every site's agent, a broker replica,
the demo's managed service), run by cpn.launcher until Ctrl-C; `--slurm` adds a site on a
local Slurm (cpn.slurm_demo).

Options that cannot go together exit 2 with one line (UsageError).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from cpn.cli_base import UsageError
from sites.model.config import config_dir

__all__ = ["add_parsers", "cmd_up"]


def cmd_up(args: argparse.Namespace) -> int:
    from cpn.launcher import Launcher, LaunchSettings

    if args.etcd_members < 1:
        raise UsageError(f"--etcd-members must be at least 1, got {args.etcd_members}")
    if args.etcd_members > 1 and (args.etcd or os.environ.get("CPN_ETCD")):
        raise UsageError("--etcd-members starts an embedded cluster: not with --etcd/CPN_ETCD")
    if args.secure and (args.etcd or os.environ.get("CPN_ETCD")):
        raise UsageError(
            "--secure starts its own etcd with TLS; to secure yours: cpn certs init, then "
            "cpn etcd secure (docs/auth.md)"
        )

    settings = LaunchSettings(
        config_dir=Path(args.config_dir) if args.config_dir else config_dir(),
        etcd=args.etcd or os.environ.get("CPN_ETCD"),
        interval_s=args.interval,
        wan_emulation=not args.no_wan_emulation,
        only=tuple(s for s in (args.sites or "").split(",") if s),
        broker_listen=args.broker_listen,
        etcd_members=args.etcd_members,
        secure=args.secure,
        demo_service=not args.no_service,
        service_file=Path(args.service) if args.service else None,
    )
    if args.slurm:  # one more site, slurm-lab, on a local Slurm (cpn/slurm_demo.py)
        from cpn.slurm_demo import run_with_slurm

        return run_with_slurm(settings)
    return Launcher(settings).run()


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    etcd_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn up`, added with cpn.cli's `add` and `etcd_arg`."""
    up = add("up", help="start a demo federation: etcd, every site's agent")
    etcd_arg(up)
    up.add_argument("--config-dir", metavar="DIR", help="configs/ directory to run")
    up.add_argument("--interval", type=float, default=2.0, help="agent publish period (s)")
    up.add_argument("--sites", metavar="ID,ID", help="run only these sites")
    up.add_argument("--broker-listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    up.add_argument(
        "--no-wan-emulation", action="store_true", help="plain loopback, no emulated RTT"
    )
    up.add_argument(
        "--etcd-members",
        type=int,
        default=1,
        metavar="N",
        help="embedded etcd as a raft cluster of N members (3 survives one member's loss)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="etcd with TLS and auth, an etcd user per site, the broker and the agents on HTTPS",
    )
    up.add_argument(
        "--slurm", action="store_true", help="add site slurm-lab on a local Slurm (docs/slurm.md)"
    )
    up.add_argument(
        "--service",
        metavar="FILE",
        help="the demo's managed service (default: configs/services/example.yaml)",
    )
    up.add_argument(
        "--no-service", action="store_true", help="apply no managed service to the demo"
    )
    up.set_defaults(func=cmd_up)
