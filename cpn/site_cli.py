"""`cpn sites`, `cpn site validate|join|leave`: the federation's sites, read from and written
to the registry (etcd) directly, not through a broker.

A site file with a problem exits 2 naming the file and the field (ConfigError); an
unreachable registry exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from cpn import render
from cpn.cli_base import CliParser, catalog_of, pki_of, registry_of
from sites.kits.clock import SystemClock
from sites.model.config import load_sites
from sites.registry.admin import auth_enabled, revoke_site

__all__ = ["add_parsers", "cmd_site_join", "cmd_site_leave", "cmd_site_validate", "cmd_sites"]


async def cmd_sites(args: argparse.Namespace) -> int:
    catalog = catalog_of(args)
    async with registry_of(args) as registry:
        snap = await registry.snapshot()
    views = snap.views()
    if args.output == "json":
        print(json.dumps([render.site_json(v, now=SystemClock().time()) for v in views], indent=2))
    elif args.nodes:
        print(render.nodes_table(views, catalog=catalog))
    else:
        print(render.sites_table(views, catalog=catalog, now=SystemClock().time()))
    return 0


def cmd_site_validate(args: argparse.Namespace) -> int:
    specs = load_sites([Path(p) for p in args.files], catalog_of(args))
    for spec in specs:
        print(
            f"{spec.id}: ok ({spec.region}, {sum(p.count for p in spec.inventory.devices)} devices)"
        )
    return 0


async def cmd_site_join(args: argparse.Namespace) -> int:
    from cpn.secure import site_credentials

    specs = load_sites([Path(p) for p in args.files], catalog_of(args))
    async with registry_of(args) as registry:
        for spec in specs:
            new = await registry.join(spec)
            # on a secure etcd, the site's own user, which may write only the site's keys
            creds = await site_credentials(registry, pki_of(args), spec)
            print(f"site {spec.id} {'joined' if new else 'updated'} ({spec.region})")
            if creds is not None:
                print(f"  etcd user site-{spec.id}; its agent's credentials: {creds}")
    return 0


async def cmd_site_leave(args: argparse.Namespace) -> int:
    clock = SystemClock()
    async with registry_of(args) as registry:
        deadline = clock.monotonic() + args.wait
        while True:
            result = await registry.leave(args.site, now=clock.time())
            if result.removed:
                if registry.tls is not None and await auth_enabled(registry):
                    await revoke_site(registry, args.site)
                print(f"site {args.site} drained and removed")
                return 0
            if clock.monotonic() >= deadline:
                break
            await asyncio.sleep(min(1.0, max(0.0, deadline - clock.monotonic())))
    print(
        f"site {args.site} cordoned: no new work; {result.pending_assignments} job(s) still "
        "assigned. Run `cpn site leave` again once they finish to remove it."
    )
    return 0


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    etcd_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn sites` and `cpn site ...`, added with cpn.cli's `add` and `etcd_arg`."""
    sites = add("sites", help="list the federation's sites")
    etcd_arg(sites)
    sites.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sites.add_argument(
        "--nodes", action="store_true", help="each declared node: its island and what it has free"
    )
    sites.set_defaults(func=cmd_sites)

    site = add("site", help="onboard or remove a site")
    site_sub = site.add_subparsers(dest="site_command", required=True, parser_class=CliParser)
    validate = site_sub.add_parser("validate", help="check site files; exit 2 on any problem")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--catalog", metavar="FILE")
    validate.set_defaults(func=cmd_site_validate)
    join = site_sub.add_parser("join", help="register (or update) sites from their files")
    join.add_argument("files", nargs="+", metavar="FILE")
    etcd_arg(join)
    join.add_argument(
        "--certs", metavar="DIR", help="CA issuing site credentials on a secure etcd "
        "(default: $CPN_CERTS, else cpn up's)"
    )  # fmt: skip
    join.set_defaults(func=cmd_site_join)
    leave = site_sub.add_parser("leave", help="cordon a site; remove it once drained")
    leave.add_argument("site", metavar="ID")
    leave.add_argument("--wait", type=float, default=0.0, help="seconds to wait for draining")
    etcd_arg(leave)
    leave.set_defaults(func=cmd_site_leave)
