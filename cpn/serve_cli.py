"""`cpn agent`, `cpn broker`: one process of a federation in the foreground, until a signal:
a site's perception agent (sites.agent) or a broker replica (broker.server).

`cpn agent` exits 1 when its agent stopped on a fault, 0 when it was asked to stop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from cpn.cli_base import UsageError, catalog_of, etcd_access, registry_of
from sites.agent.collectors.probes import METHODS
from sites.agent.process import Agent
from sites.agent.settings import AgentSettings
from sites.kits import sd_notify
from sites.kits.clock import process_clock
from sites.model.config import config_dir, load_site

__all__ = ["add_parsers", "cmd_agent", "cmd_broker"]


async def cmd_agent(args: argparse.Namespace) -> int:
    catalog = catalog_of(args)
    spec = load_site(Path(args.site), catalog)
    service_urls: dict[str, str] = {}
    for item in args.service_url or []:
        name, sep, url = item.partition("=")
        if not sep or not url:
            raise UsageError(f"--service-url {item!r}: expected NAME=URL")
        service_urls[name] = url
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
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
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        tls_crl=args.tls_crl,
    )
    try:
        clock = process_clock()  # the system's, unless a fault is injected (docs/chaos.md)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    async with registry_of(args) as registry:
        agent = Agent(spec=spec, catalog=catalog, registry=registry, settings=settings, clock=clock)
        await agent.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, agent.stopped.set)
        print(f"agent of {spec.id} serving {agent.url} (pid {os.getpid()})", flush=True)
        # under systemd (Type=notify): started once the site is held and its server answers
        sd_notify.notify("READY=1", f"STATUS=agent of {spec.id} serving {agent.url}")
        interval = sd_notify.watchdog_interval_s()
        if interval is not None:
            agent.supervisor.spawn("watchdog", lambda: sd_notify.watchdog_loop(interval))
        await agent.stopped.wait()
        sd_notify.notify("STOPPING=1")
        await agent.stop()
        if agent.stop_reason:
            print(f"agent of {spec.id} stopped: {agent.stop_reason}", file=sys.stderr)
    return 1 if agent.crashed else 0


async def cmd_broker(args: argparse.Namespace) -> int:
    from broker.server import serve

    etcd, etcd_tls = etcd_access(args)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    await serve(
        etcd=etcd,
        etcd_tls=etcd_tls,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        agent_ca=Path(args.agent_ca) if args.agent_ca else None,
        agent_crl=Path(args.agent_crl) if args.agent_crl else None,
        listen=args.listen,
        config_dir=Path(args.config_dir) if args.config_dir else config_dir(),
        wan_emulated=args.wan_emulated,
        state_dir=broker_state_dir(args.state_dir, args.listen),
    )
    return 0


def broker_state_dir(given: str | None, listen: str) -> Path:
    """Where a broker keeps its state (the token ledger's write-ahead file and the replica's
    id): --state-dir, else $CPN_STATE_DIR, else ~/.local/state/cpn/broker-<port>."""
    if given:
        return Path(given)
    if os.environ.get("CPN_STATE_DIR"):
        return Path(os.environ["CPN_STATE_DIR"])
    port = listen.rsplit(":", 1)[-1]
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "cpn" / f"broker-{port}"


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    etcd_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn agent` and `cpn broker`, added with cpn.cli's `add` and `etcd_arg`."""
    agent = add("agent", help="run the perception agent of one site")
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
    agent.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    agent.add_argument("--tls-key", metavar="FILE", help="the certificate's private key")
    agent.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="verify peers' https:// endpoints against this CA (the federation's)",
    )
    agent.add_argument(
        "--tls-crl",
        metavar="FILE",
        help="refuse peers whose certificates this CRL lists (re-read as it changes)",
    )
    agent.set_defaults(func=cmd_agent)

    broker = add("broker", help="run a broker replica (API, placement, failover)")
    etcd_arg(broker)
    broker.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    broker.add_argument("--config-dir", metavar="DIR", help="configs/ directory")
    broker.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate")
    broker.add_argument("--tls-key", metavar="FILE", help="the certificate's private key")
    broker.add_argument(
        "--agent-ca",
        metavar="FILE",
        help="verify the agents' https:// endpoints against this CA (the federation's)",
    )
    broker.add_argument(
        "--agent-crl",
        metavar="FILE",
        help="refuse agents whose certificates this CRL lists (re-read as it changes)",
    )
    broker.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the replica's own state: the token ledger's write-ahead file and its id "
        "(default: $CPN_STATE_DIR, else ~/.local/state/cpn/broker-PORT)",
    )
    broker.add_argument(
        "--wan-emulated",
        action="store_true",
        help="one-machine demo: send each client region's requests from its loopback address",
    )
    broker.set_defaults(func=cmd_broker)
