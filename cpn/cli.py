"""The `cpn` command line.

User errors exit 2 with one line on stderr (`cpn: error: ...`); an unreachable registry or
another run-time failure exits 1. `-o json` prints machine-readable output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn

from cpn import render
from cpn.state import read_up_state
from sites.agent import Agent, AgentSettings
from sites.catalog import CatalogError, DeviceCatalog
from sites.clock import SystemClock
from sites.collectors.probes import METHODS
from sites.config import config_dir, load_site, load_sites
from sites.errors import AgentConflict, ConfigError, NotJoined, RegistryError, SitesError
from sites.registry import Registry, parse_endpoints

log = logging.getLogger("cpn")


class UsageError(Exception):
    """Bad input from the user: exit 2."""


class CliParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"cpn: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _etcd_url(args: argparse.Namespace) -> str:
    url: str | None = args.etcd or os.environ.get("CPN_ETCD")
    if not url:
        state = read_up_state()
        url = state.get("etcd") if state else None
    if not url:
        raise UsageError("no etcd: pass --etcd URL[,URL...], set CPN_ETCD, or start `cpn up`")
    try:
        parse_endpoints(url)
    except ValueError as exc:
        raise UsageError(f"--etcd: {exc}") from None
    return url


def _catalog(args: argparse.Namespace) -> DeviceCatalog:
    path = Path(args.catalog) if getattr(args, "catalog", None) else None
    return DeviceCatalog.load(path)


# -- commands ------------------------------------------------------------------------------


async def cmd_sites(args: argparse.Namespace) -> int:
    catalog = _catalog(args)
    async with Registry.from_urls(_etcd_url(args)) as registry:
        snap = await registry.snapshot()
    views = snap.views()
    if args.output == "json":
        print(json.dumps([render.site_json(v, now=SystemClock().time()) for v in views], indent=2))
    else:
        print(render.sites_table(views, catalog=catalog, now=SystemClock().time()))
    return 0


def cmd_site_validate(args: argparse.Namespace) -> int:
    specs = load_sites([Path(p) for p in args.files], _catalog(args))
    for spec in specs:
        print(
            f"{spec.id}: ok ({spec.region}, {sum(p.count for p in spec.inventory.devices)} devices)"
        )
    return 0


async def cmd_site_join(args: argparse.Namespace) -> int:
    specs = load_sites([Path(p) for p in args.files], _catalog(args))
    async with Registry.from_urls(_etcd_url(args)) as registry:
        for spec in specs:
            new = await registry.join(spec)
            print(f"site {spec.id} {'joined' if new else 'updated'} ({spec.region})")
    return 0


async def cmd_site_leave(args: argparse.Namespace) -> int:
    clock = SystemClock()
    async with Registry.from_urls(_etcd_url(args)) as registry:
        deadline = clock.monotonic() + args.wait
        while True:
            result = await registry.leave(args.site, now=clock.time())
            if result.removed:
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


async def cmd_agent(args: argparse.Namespace) -> int:
    catalog = _catalog(args)
    spec = load_site(Path(args.site), catalog)
    service_urls: dict[str, str] = {}
    for item in args.service_url or []:
        name, sep, url = item.partition("=")
        if not sep or not url:
            raise UsageError(f"--service-url {item!r}: expected NAME=URL")
        service_urls[name] = url
    settings = AgentSettings.from_spec(
        spec,
        listen=args.listen,
        advertise=args.advertise,
        probe_listen=args.probe_listen,
        probe_advertise=args.probe_advertise,
        interval_s=args.interval,
        probe_method=args.probe_method,
        wan_emulated=args.wan_emulated,
        service_urls=service_urls,
    )
    async with Registry.from_urls(_etcd_url(args)) as registry:
        agent = Agent(spec=spec, catalog=catalog, registry=registry, settings=settings)
        await agent.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, agent.stopped.set)
        print(f"agent of {spec.id} serving {agent.url} (pid {os.getpid()})", flush=True)
        await agent.stopped.wait()
        await agent.stop()
        if agent.stop_reason:
            print(f"agent of {spec.id} stopped: {agent.stop_reason}", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from cpn.launcher import Launcher, LaunchSettings

    settings = LaunchSettings(
        config_dir=Path(args.config_dir) if args.config_dir else config_dir(),
        etcd=args.etcd or os.environ.get("CPN_ETCD"),
        interval_s=args.interval,
        wan_emulation=not args.no_wan_emulation,
        only=tuple(s for s in (args.sites or "").split(",") if s),
    )
    return Launcher(settings).run()


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="cpn", description="cross-region computing-power network")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)

    def etcd_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--etcd",
            metavar="URL[,URL...]",
            help="etcd endpoints (default: $CPN_ETCD, else the etcd of a running `cpn up`)",
        )
        p.add_argument("--catalog", metavar="FILE", help="device catalog (configs/devices.yaml)")

    up = sub.add_parser("up", help="start a demo federation: etcd, every site's agent")
    etcd_arg(up)
    up.add_argument("--config-dir", metavar="DIR", help="configs/ directory to run")
    up.add_argument("--interval", type=float, default=2.0, help="agent publish period (s)")
    up.add_argument("--sites", metavar="ID,ID", help="run only these sites")
    up.add_argument(
        "--no-wan-emulation", action="store_true", help="plain loopback, no emulated RTT"
    )
    up.set_defaults(func=cmd_up)

    sites = sub.add_parser("sites", help="list the federation's sites")
    etcd_arg(sites)
    sites.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sites.set_defaults(func=cmd_sites)

    site = sub.add_parser("site", help="onboard or remove a site")
    site_sub = site.add_subparsers(dest="site_command", required=True, parser_class=CliParser)
    validate = site_sub.add_parser("validate", help="check site files; exit 2 on any problem")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--catalog", metavar="FILE")
    validate.set_defaults(func=cmd_site_validate)
    join = site_sub.add_parser("join", help="register (or update) sites from their files")
    join.add_argument("files", nargs="+", metavar="FILE")
    etcd_arg(join)
    join.set_defaults(func=cmd_site_join)
    leave = site_sub.add_parser("leave", help="cordon a site; remove it once drained")
    leave.add_argument("site", metavar="ID")
    leave.add_argument("--wait", type=float, default=0.0, help="seconds to wait for draining")
    etcd_arg(leave)
    leave.set_defaults(func=cmd_site_leave)

    agent = sub.add_parser("agent", help="run the perception agent of one site")
    agent.add_argument("--site", required=True, metavar="FILE", help="the site's YAML file")
    etcd_arg(agent)
    agent.add_argument("--listen", metavar="HOST:PORT", help="override agent.listen")
    agent.add_argument("--advertise", metavar="HOST:PORT", help="address peers should use")
    agent.add_argument("--probe-listen", metavar="HOST:PORT", help="probe responder address")
    agent.add_argument("--probe-advertise", metavar="HOST:PORT", help="address peers probe")
    agent.add_argument("--interval", type=float, help="override agent.interval_s")
    agent.add_argument("--probe-method", choices=METHODS, default="auto")
    agent.add_argument("--wan-emulated", action="store_true", help="label links as emulated")
    agent.add_argument("--service-url", action="append", metavar="NAME=URL")
    agent.set_defaults(func=cmd_agent)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        result = args.func(args)
        if isinstance(result, Coroutine):
            result = _run(result)
        return int(result)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"cpn: error: {problem}", file=sys.stderr)
        return 2
    except (UsageError, CatalogError, NotJoined, AgentConflict, ValueError) as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 2
    except (RegistryError, SitesError, OSError) as exc:
        print(f"cpn: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(coro: Coroutine[Any, Any, int]) -> int:
    return asyncio.run(coro)
