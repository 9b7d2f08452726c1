"""Run a broker replica: mirrors, leader election, the reconcile loop and the HTTP API."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from broker.api.app import make_app
from broker.api.inference import Gateway
from broker.model.regions import load_user_regions, user_rtt_ms
from broker.model.tenants import load_tenancy
from broker.placement.settings import BrokerSettings, load_settings, read_site_keys
from broker.process import RESTART, Broker, until_answered
from broker.state.router import Router
from routing import native
from routing.decision.clients import load_clients
from routing.gateway.lane_site import LaneSite
from sites.kits import sd_notify
from sites.kits.tls import PeerTrust, ReloadingServer
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, site_files
from sites.model.latency import LatencyModel
from sites.registry.client import Registry
from sites.registry.crl import follow_crl
from sites.registry.security import EtcdTls

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
"""How long a thread holding the GIL keeps it while another waits (CPython: 5 ms). The broker
runs whole-federation work on worker threads (the alert rules, /metrics' text) so that it does
not hold the event loop; but each time the loop gives up the GIL (every socket call does) it
waited up to the whole interval to get it back, so a request in flight while the alert rules
ran (36 ms at a thousand sites, every 5 s) took 30-50 ms instead of 5. At 0.5 ms the loop
waits at most that."""

GC_THRESHOLDS = (700, 1000, 100)
"""The collector's thresholds once the broker is up (CPython's are 700, 10, 10). A federation's
view is objects that live about one publish interval (a thousand sites' statuses and links
replaced every second, 25,000 objects young at any time): each middle-generation collection
scanned them all for 16-27 ms and found no garbage, and full collections of 80-140 ms came
every few seconds, pauses every request in flight waited out. That garbage is freed by
reference counting; the cyclic collector still runs its young pass every 700 net allocations
(under 8 ms), the middle one a hundred times and the full one a thousand times more rarely
(bench/JOURNAL.md, 2026-12-05, live_federation.py)."""


async def serve(
    *,
    etcd: str,
    etcd_tls: EtcdTls | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    agent_ca: Path | None = None,
    agent_crl: Path | None = None,
    listen: str,
    config_dir: Path,
    settings: BrokerSettings | None = None,
    ready: asyncio.Event | None = None,
    wan_emulated: bool = False,
    state_dir: Path | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation). HTTPS when `tls_cert` and `tls_key` are
    given; `etcd_tls` is the broker's etcd credentials on a secure etcd; `agent_ca` the CA the
    agents' certificates are checked against (https:// agents; default: the system's CAs) and
    `agent_crl` its revocation list; the certificate files and the CRL are re-read as they
    change (sites.kits.tls), so rotating them needs no restart."""
    catalog = DeviceCatalog.load(config_dir / "devices.yaml")
    regions = load_user_regions(config_dir / "regions.yaml")
    specs = load_sites(site_files(config_dir / "sites"), catalog)
    latency = LatencyModel.from_dir(config_dir / "latency")
    tenancy = load_tenancy(config_dir / "tenants.yaml")
    if settings is None:
        settings = load_settings(config_dir / "broker.yaml")
    site_keys = read_site_keys(settings.inference, str(config_dir / "broker.yaml"))
    host, port = listen.rsplit(":", 1)
    reloading = None
    if tls_cert is not None and tls_key is not None:
        reloading = ReloadingServer(tls_cert, tls_key)
    ssl_context = None if reloading is None else reloading.context
    agent_trust = PeerTrust(agent_ca, agent_crl)
    scheme = "https" if ssl_context else "http"
    clients = None
    if (config_dir / "clients.yaml").exists():
        clients = load_clients(config_dir / "clients.yaml", user_regions=regions, sites=specs)
    registry = Registry.from_urls(etcd, tls=etcd_tls)
    await until_answered("connecting to etcd", registry.connect)
    broker = Broker(
        registry=registry,
        catalog=catalog,
        user_rtt_ms=user_rtt_ms(regions, specs, latency),
        tenancy=tenancy,
        settings=settings,
        url=f"{scheme}://{listen}",
        agent_trust=agent_trust,
        # managed services' replicas for a client region run where it may be served
        sovereignty=clients.sovereignty() if clients is not None else None,
        # the leader's scheduled backups (docs/backup.md): none in-process without a state dir
        backup_dir=settings.backup.dir or (state_dir / "backups" if state_dir else None),
    )
    if reloading is not None:
        reloading.expose(broker.metrics.registry, "cpn_broker")
    router = None
    if clients is not None:
        router = Router(
            clients=clients,
            user_regions=regions,
            latency=latency,
            settings=settings.inference.routing,
            metrics=broker.metrics,
        )
    else:
        log.warning("no %s: inference routing is off", config_dir / "clients.yaml")
    app = make_app(broker, router)
    gateway = None
    if router is not None:
        sources = {}
        if wan_emulated:  # emulated WAN: each client region's traffic leaves from its own address
            sources = router.clients.loopback_sources()
        gateway = Gateway(
            broker=broker,
            router=router,
            settings=broker.settings.inference,
            client_source_ips=sources,
            site_keys=site_keys,
            # in-process (tests, tools) without one: a fresh directory, nothing to recover
            state_dir=state_dir or Path(tempfile.mkdtemp(prefix=f"cpn-broker-{port}-")),
        )
        gateway.install(app)

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await broker.start()
        if agent_crl is not None:
            broker.supervisor.spawn("crl", agent_trust.follow, restart=RESTART)
        if agent_ca is not None:  # the CRL of that CA, as `cpn certs revoke --publish` puts it
            broker.supervisor.spawn(
                "published crl", lambda: follow_crl(registry, agent_trust), restart=RESTART
            )
        if router is not None:  # a route finds the topology built and current
            router.sync(broker.view().sites)
            broker.supervisor.spawn(
                "router", lambda: router.follow(lambda: broker.view().sites), restart=RESTART
            )
        # what is alive now (modules, schemas, OR-Tools, the first view) lives as long as the
        # process: out of the collector's sight, a full collection at 1000 sites is 130 ms,
        # not 340-470 (bench/JOURNAL.md, 2026-12-01 and 2026-12-05, live_federation.py)
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        yield
        await broker.stop()

    app.cleanup_ctx.append(lifetime)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site: web.TCPSite
        if gateway is not None:  # /v1/infer on the inference lane, the rest on aiohttp
            site = LaneSite(
                runner,
                host,
                int(port),
                proxy=lambda: gateway.proxy,
                guard=gateway.guard(app),
                reuse_address=True,
                ssl_context=ssl_context,
            )
        else:
            site = web.TCPSite(runner, host, int(port), reuse_address=True, ssl_context=ssl_context)
        await site.start()
        log.info(
            "broker %s serving %s://%s (inference hot path: %s)",
            broker.instance,
            scheme,
            listen,
            native.state(),
        )
        print(f"broker serving {scheme}://{listen} (etcd {etcd})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        # under systemd (Type=notify): started once the view is built and the API answers
        sd_notify.notify("READY=1", f"STATUS=broker {broker.instance} serving {scheme}://{listen}")
        interval = sd_notify.watchdog_interval_s()
        if interval is not None:
            broker.supervisor.spawn("watchdog", lambda: sd_notify.watchdog_loop(interval))
        await stop.wait()
        sd_notify.notify("STOPPING=1")
    finally:
        await runner.cleanup()
        await registry.close()
