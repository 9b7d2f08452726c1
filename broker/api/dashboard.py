"""The operator's dashboard (docs/dashboard.md): a page at `/` with its static assets, shipped in
the package (broker/api/static/dashboard/), and GET /v1/routes/summary, where each client region's
inference traffic went (this replica's counters) and what each managed service's client regions
asked of every replica's gateway (/cpn/v1/traffic, broker.state.traffic: cumulative counts, which
the page turns into rates between two polls, as Prometheus' rate() does).

The page itself holds no data and is public. Everything it shows comes from the JSON API with
the bearer token the operator gives it (in the URL fragment, which browsers never send, or in
its form; kept in sessionStorage), so the page shows nothing without a token and, with one,
what that token's role may see. Assets are read once per process and served from memory under
a Content-Security-Policy that allows scripts, styles and requests from this origin only:
nothing is fetched from the internet, and there is no build step.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from aiohttp import web
from pydantic import BaseModel, Field

from broker.api.openapi import Operation, Param, Reply
from broker.state.metrics import BrokerMetrics
from broker.state.traffic import TrafficSummary
from sites.model import keys
from sites.registry.client import Registry

__all__ = [
    "ASSETS",
    "RouteFlow",
    "RouteSummary",
    "ServiceDemand",
    "dashboard_operations",
    "route_flows",
    "service_demand",
]

ASSETS = ("index.html", "app.js", "data.js", "map.js", "services.js", "world.js", "style.css")
"""The dashboard's files in broker/api/static/dashboard/ (index.html is served at /)."""

_TYPES = {
    "html": "text/html; charset=utf-8",
    "js": "text/javascript; charset=utf-8",
    "css": "text/css; charset=utf-8",
}
# same origin only: no CDN, no inline script, no frame around it; the token never leaves
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated by ETag: an upgraded broker's page shows at once
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


@functools.cache
def _assets() -> dict[str, Asset]:
    folder = resources.files("broker.api").joinpath("static", "dashboard")
    out = {}
    for name in ASSETS:
        body = folder.joinpath(name).read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        out[name] = Asset(body, _TYPES[name.rsplit(".", 1)[1]], etag)
    return out


def _serve(request: web.Request, name: str) -> web.Response:
    asset = _assets().get(name)
    if asset is None:
        raise web.HTTPNotFound()
    headers = {**_HEADERS, "ETag": asset.etag}
    if request.headers.get("If-None-Match") == asset.etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})


async def index(request: web.Request) -> web.Response:
    return _serve(request, "index.html")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    if name == "index.html":  # one address per page: /
        raise web.HTTPNotFound()
    return _serve(request, name)


class RouteFlow(BaseModel):
    """Inference traffic from one client region to one site, on this replica."""

    client_region: str
    site: str = Field(description='the chosen site; "none": no site could take the request')
    decisions: int = Field(description="routing decisions (POST /v1/route and the gateway)")
    proxied: int = Field(description="requests the gateway proxied there (answered or not)")
    proxy_seconds_sum: float = Field(description="their summed time to the last byte, s")


class ServiceDemand(BaseModel):
    """One managed service's requests from one client region, over every broker replica."""

    service: str
    client_region: str
    requests: int = Field(
        description="requests the replicas' gateways took, each since it started (cumulative)"
    )


class RouteSummary(BaseModel):
    """The reply of GET /v1/routes/summary."""

    instance: str = Field(description="the replica whose counters these are")
    items: list[RouteFlow] = Field(description="by client region, then site")
    services: list[ServiceDemand] = Field(
        default_factory=list,
        description="managed services' demand by client region, every replica's gateway "
        "summed (/cpn/v1/traffic); by service, then client region",
    )
    services_at: float | None = Field(
        default=None, description="unix s of the newest traffic summary summed in `services`"
    )
    services_instances: int = Field(
        default=0, description="broker replicas whose traffic summaries were summed"
    )


def route_flows(metrics: BrokerMetrics) -> list[RouteFlow]:
    """cpn_route_decisions_total and cpn_proxy_request_duration_seconds by (client region,
    site), read from the counters themselves (what /metrics exports, without the text)."""
    flows: dict[tuple[str, str], dict[str, float]] = {}
    for family in (*metrics.route_decisions.collect(), *metrics.proxy_seconds.collect()):
        for sample in family.samples:
            field = {
                "cpn_route_decisions_total": "decisions",
                "cpn_proxy_request_duration_seconds_count": "proxied",
                "cpn_proxy_request_duration_seconds_sum": "proxy_seconds_sum",
            }.get(sample.name)
            if field is None:
                continue
            key = (sample.labels["client_region"], sample.labels["site"])
            flows.setdefault(key, {})[field] = sample.value
    return [
        RouteFlow(
            client_region=region,
            site=site,
            decisions=int(got.get("decisions", 0)),
            proxied=int(got.get("proxied", 0)),
            proxy_seconds_sum=round(got.get("proxy_seconds_sum", 0.0), 6),
        )
        for (region, site), got in sorted(flows.items())
    ]


# a replica's summary older than this is left out: stuck or cut off (as the autoscaler does)
TRAFFIC_MAX_AGE_S = 10.0


def service_demand(
    summaries: list[TrafficSummary], now: float
) -> tuple[list[ServiceDemand], float | None, int]:
    """Per (service, client region), the replicas' cumulative requests summed; the newest
    summary's time; how many replicas were summed (those fresher than TRAFFIC_MAX_AGE_S)."""
    fresh = [s for s in summaries if now - s.at <= TRAFFIC_MAX_AGE_S]
    sums: dict[tuple[str, str], int] = {}
    for summary in fresh:
        for service, regions in summary.services.items():
            for region, counts in regions.items():
                sums[(service, region)] = sums.get((service, region), 0) + counts.requests
    items = [
        ServiceDemand(service=service, client_region=region, requests=n)
        for (service, region), n in sorted(sums.items())
    ]
    return items, max((s.at for s in fresh), default=None), len(fresh)


async def _traffic(registry: Registry) -> list[TrafficSummary]:
    _, published = await registry.list_prefix(keys.TRAFFIC)
    out = []
    for _key, value, _rev in published:
        try:
            out.append(TrafficSummary.model_validate_json(value))
        except ValueError:
            continue  # a replica of another version: its summary is not summed
    return out


async def routes_summary(request: web.Request) -> web.Response:
    from broker.api.keys import BROKER

    broker = request.app[BROKER]
    services, at, instances = service_demand(await _traffic(broker.registry), broker.clock.time())
    summary = RouteSummary(
        instance=broker.instance,
        items=route_flows(broker.metrics),
        services=services,
        services_at=at,
        services_instances=instances,
    )
    return web.json_response(summary.model_dump(mode="json"))


def dashboard_operations() -> list[Operation]:
    page = Reply("the page (its data comes from the API, with a token)", {"type": "string"}, "text/html")  # fmt: skip  # noqa: E501
    return [
        Operation("GET", "/", index, "The operator's dashboard", "dashboard", replies={200: page}),
        Operation(
            "GET", "/dashboard/{asset}", asset, "A script or style sheet of the dashboard",
            "dashboard_asset",
            params=(Param("asset", "path", "the file", {"type": "string",
                                                        "enum": list(ASSETS[1:])}),),
            replies={200: Reply("the file", {"type": "string"}, "text/*")}, errors=(404,),
        ),
        Operation(
            "GET", "/v1/routes/summary", routes_summary,
            "Where each client region's inference traffic went (this replica's counters), and "
            "each managed service's requests per client region (every replica's gateway)",
            "routes_summary",
            replies={200: Reply("route decisions and proxied requests by region and site",
                                RouteSummary)},
        ),
    ]  # fmt: skip
