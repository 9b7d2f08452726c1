"""`cpn up`'s address plan with the WAN emulation (docs/wan-emulation.md).

Site number N (1-based, in id order) owns 127.0.1.N; its agent listens there and its probes
leave from there; peers reach it through the emulator's front 127.0.2.N on the same port, which
delays each direction by rtt/2 and shapes it to the path's bandwidth (configs/latency/
bandwidth.yaml: the distance class's figure scaled for loopback, or a per-path override). So
do its services' model servers. A client region sends from
its own loopback address (configs/clients.yaml) and reaches a site through its best ingress
site: the access RTT there plus the WAN RTT on.

`emulator` makes the emulator (it runs in `cpn up`'s own process); `route` gives each site its
addresses and routes them through it, and the launcher starts the site's processes on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from broker.model.regions import load_user_regions
from routing.decision.clients import load_clients
from sites.emulation import wan
from sites.emulation.etcd_server import free_port
from sites.model.bandwidth import BandwidthModel
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import SiteSpec

__all__ = [
    "BANDWIDTH_FILE",
    "CLIENT",
    "SiteRoutes",
    "bandwidth_model",
    "emulator",
    "endpoint_of",
    "front_ip",
    "node_ip",
    "route",
]

BANDWIDTH_FILE = "latency/bandwidth.yaml"  # under the config dir

CLIENT = "client:"  # emulator node names of client regions


def node_ip(n: int) -> str:
    return f"127.0.1.{n}"


def front_ip(n: int) -> str:
    return f"127.0.2.{n}"


def endpoint_of(spec: SiteSpec) -> Endpoint:
    return Endpoint(lat=spec.coordinates.lat, lon=spec.coordinates.lon, zone=spec.latency_zone)


@dataclass
class SiteRoutes:
    """A site's addresses: where its agent and probe responder listen, where peers reach them
    (the emulator's fronts), and each service's URL through the emulator."""

    listen: str
    advertise: str
    probe_listen: str
    probe_advertise: str
    service_urls: dict[str, str] = field(default_factory=dict)


def bandwidth_model(config_dir: Path) -> BandwidthModel:
    """The demo's bandwidth table (configs/latency/bandwidth.yaml; the defaults without it)."""
    return BandwidthModel.from_file(config_dir / BANDWIDTH_FILE)


def emulator(config_dir: Path, specs: Sequence[SiteSpec]) -> wan.WanEmulator:
    """The emulator of the sites' WAN (configs/latency) and of the client regions' paths.

    Site-to-site paths are shaped to the bandwidth table's figure; a client region's paths
    carry inference requests and are not shaped."""
    latency = LatencyModel.from_dir(config_dir / "latency")
    bandwidth = bandwidth_model(config_dir)
    by_id = {spec.id: spec for spec in specs}
    endpoints = {spec.id: endpoint_of(spec) for spec in specs}

    def mbps(src: str, dst: str) -> float | None:
        a, b = by_id.get(src), by_id.get(dst)
        if a is None or b is None:  # a client region
            return None
        return bandwidth.mbps(a, b, emulated=True)

    def rtt(src: str, dst: str) -> float:
        return latency.rtt_ms(endpoints[src], endpoints[dst])

    ips = {node_ip(n): spec.id for n, spec in enumerate(specs, start=1)}
    client_rtt, sources = _client_rtts(config_dir, specs, latency, rtt)
    # client regions get their own node names: "frankfurt" is both a site and a client region
    ips.update({ip: CLIENT + region for region, ip in sources.items()})

    def path_rtt(src: str, dst: str) -> float:
        if src.startswith(CLIENT):  # a client region reaches a site through its ingress
            return client_rtt[src.removeprefix(CLIENT)].get(dst, 0.0)
        return rtt(src, dst)

    return wan.WanEmulator(node_of_ip=ips, rtt_ms=path_rtt, bandwidth_mbps=mbps)


async def route(emulator: wan.WanEmulator, specs: Sequence[SiteSpec]) -> list[SiteRoutes]:
    """Each site's addresses (in the order of `specs`), its agent's, probes' and services'
    routes added to `emulator`."""
    out = []
    for n, spec in enumerate(specs, start=1):
        port = free_port(node_ip(n))
        host, fport = await emulator.add_route(
            front=(front_ip(n), port), backend=(node_ip(n), port), node=spec.id
        )
        pport = free_port(node_ip(n))
        phost, pfport = await emulator.add_route(
            front=(front_ip(n), pport), backend=(node_ip(n), pport), node=spec.id
        )
        routes = SiteRoutes(
            listen=f"{node_ip(n)}:{port}",
            advertise=f"{host}:{fport}",
            probe_listen=f"{node_ip(n)}:{pport}",
            probe_advertise=f"{phost}:{pfport}",
        )
        for svc in spec.services:
            parts = urlsplit(svc.url)
            backend = (parts.hostname or "127.0.0.1", parts.port or 80)
            shost, sport = await emulator.add_route(
                front=(front_ip(n), backend[1]), backend=backend, node=spec.id
            )
            routes.service_urls[svc.name] = urlunsplit(parts._replace(netloc=f"{shost}:{sport}"))
        out.append(routes)
    return out


def _client_rtts(
    config_dir: Path,
    specs: Sequence[SiteSpec],
    latency: LatencyModel,
    rtt: Callable[[str, str], float],
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Client region -> site -> RTT (the best ingress site's access RTT plus its WAN RTT),
    and client region -> the loopback address it sends from (its 127.0.3.n/32 in
    configs/clients.yaml), as the broker's proxy does on its behalf when the WAN is emulated.
    """
    path = config_dir / "clients.yaml"
    if not path.exists():
        return {}, {}
    regions = load_user_regions(config_dir / "regions.yaml")
    by_id = {spec.id: spec for spec in specs}
    clients = load_clients(path, user_regions=regions)
    out: dict[str, dict[str, float]] = {}
    for region in clients.regions:
        attach = {
            site: ms
            for site, ms in clients.attach_rtt_ms(region, by_id, regions, latency).items()
            if site in by_id
        }
        out[region] = {
            site: min(
                (ms + (0.0 if a == site else rtt(a, site)) for a, ms in attach.items()),
                default=0.0,
            )
            for site in by_id
        }
    return out, clients.loopback_sources()
