"""The broker's inference gateway: `ANY /v1/infer/{service}/{path}` through routing's proxy.

Wires the router (topology + selection over the mirrored registry) to routing.gateway.proxy's
InferenceProxy: the chosen site first, the rest of the ranking after it for retries; passive
ejections feed back into selection; an active checker GETs every endpoint's /healthz.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import aiohttp
from aiohttp import web

from broker.api.access import (
    ACCESS,
    AUTH,
    REQUEST_ID,
    Access,
    authorize,
    new_request_id,
)
from broker.api.app import count_request
from broker.api.openapi import JSON, Operation, Param, Reply, register
from broker.model.errors import InvalidRequest, NotFound
from broker.placement.settings import InferenceSettings
from broker.process import RESTART, Broker
from broker.state.auth import Forbidden, Unauthorized
from broker.state.metrics import LoopCounter
from broker.state.router import Router
from routing.decision.candidates import site_replicas
from routing.gateway.health import (
    ActiveHealthChecker,
    HealthCheckSettings,
    OutlierDetector,
)
from routing.gateway.lane import Admission, Refusal
from routing.gateway.prefix import PREFIX_HEADER
from routing.gateway.proxy import (
    REGION_HEADER,
    SESSION_COOKIE,
    SESSION_HEADER,
    TENANT_HEADER,
    InferenceProxy,
    UnknownRegion,
    UnknownService,
    Upstream,
    upstream_key,
)
from routing.gateway.ratelimit import RateLimit, TenantLimiter
from routing.gateway.upstream import UpstreamPool

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
INFER_ROUTE = "/v1/infer/{service}/{path}"  # the route's canonical form, as metrics label it


class Gateway:
    """Owns the proxy (and its upstream connections) and the health checker; `install(app)`
    adds the route."""

    def __init__(
        self,
        *,
        broker: Broker,
        router: Router,
        settings: InferenceSettings | None = None,
        client_source_ips: dict[str, str] | None = None,
        site_keys: Mapping[tuple[str, str], str] | None = None,
    ) -> None:
        """`site_keys`: the keys of broker.placement.settings.read_site_keys, for the proxy."""
        self.broker = broker
        self.router = router
        self.settings = settings or InferenceSettings()
        # emulated WAN only: client region -> the loopback address its traffic leaves from
        self.client_source_ips = client_source_ips or {}
        self.site_keys = dict(site_keys or {})
        self.health = OutlierDetector(settings=self.settings.outlier)
        self._session: aiohttp.ClientSession | None = None  # the health checks'
        self.checker: ActiveHealthChecker | None = None
        self.proxy: InferenceProxy | None = None

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        return aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def pick(
        self,
        service: str,
        region: str | None,
        session_key: str | None,
        /,
        *,
        prefix_key: str | None = None,
    ) -> Sequence[Upstream]:
        self.router.sync(self.broker.view().sites, request=True)
        if region is None:
            raise UnknownRegion("no client region")
        try:
            region = self.router.region(region, None)
            now = time.time()
            proxy = self.proxy
            ejected = proxy.ejected_sites(service, now) if proxy is not None else {}
            usable = counted = None
            if proxy is not None:

                def usable(site: str, url: str) -> bool:
                    return proxy.replica_usable(service, site, url, now)

                def counted(site: str, url: str) -> int:
                    return proxy.replica_in_flight(service, site, url)

            chosen = self.router.pick(
                service,
                region,
                now=now,
                session_key=session_key,
                prefix_key=prefix_key,
                ejected_until=ejected,
                in_flight=proxy.in_flight(service) if proxy is not None else None,
                replica_usable=usable,
                replica_in_flight=counted,
            )
        except InvalidRequest as exc:
            raise UnknownRegion(exc.message) from None
        except NotFound as exc:
            raise UnknownService(str(exc)) from None
        source = self.client_source_ips.get(region)
        several = chosen.replica_urls
        return [
            Upstream(site, url, source, replica=site in several) for site, url in chosen.upstreams
        ]

    def _health_targets(self) -> dict[str, str]:
        """Health-check key -> URL: each endpoint of a service at a site, or each replica of a
        site that runs several (checked, and ejected, one by one)."""
        snapshot = self.router.snapshot
        targets = {}
        for (svc, site), ep in snapshot.services.items():
            replicas = site_replicas(snapshot, svc, site)
            urls = [(m.url, True) for m in replicas] or [(ep.url, False)]
            for url, replica in urls:
                key = upstream_key(svc, Upstream(site, url, replica=replica))
                targets[key] = url.rstrip("/") + "/healthz"
        return targets

    def install(self, app: web.Application) -> None:
        settings = self.settings

        async def lifetime(app: web.Application) -> AsyncIterator[None]:
            self._session = self._new_session()
            self.checker = ActiveHealthChecker(
                targets=self._health_targets,
                session=self._session,
                settings=HealthCheckSettings(interval_s=settings.health_interval_s),
            )
            # supervised with the broker's own tasks: a crash shows in /healthz, then restarts
            self.broker.supervisor.spawn("health checker", self.checker.run, restart=RESTART)
            rate = RateLimit(rate_per_s=settings.tenant_rate_per_s, burst=settings.tenant_burst)
            self.proxy = InferenceProxy(
                pick=self.pick,
                health=self.health,
                limiter=TenantLimiter(default=rate),
                connect_timeout_s=settings.connect_timeout_s,
                response_timeout_s=settings.response_timeout_s,
                max_attempts=settings.max_attempts,
                max_body_bytes=settings.max_body_bytes,
                pool=UpstreamPool(),
                known_services=self.router.services,
                resolve_region=self.router.clients.region_of,
                known_regions=lambda: self.router.clients,
                active=self.checker,
                observe=self.broker.metrics.proxied,
                prefix_chars=settings.prefix_chars,
                traffic=self.broker.traffic,  # the autoscaler's demand (broker.state.traffic)
                # a client's Authorization is its cpn token, checked here: never the site's
                drop_credentials=app[AUTH].enabled,
                site_keys=self.site_keys,  # a site's own key, where it needs one
            )
            yield
            await self.broker.supervisor.cancel("health checker")
            await self.proxy.close()
            await self._session.close()

        app.cleanup_ctx.append(lifetime)

        async def handle(request: web.Request) -> web.StreamResponse:
            if self.proxy is None:
                raise web.HTTPServiceUnavailable()
            return await self.proxy.handle(request)

        register(app, infer_operation(handle))

    def guard(self, app: web.Application) -> LaneGuard:
        """What the API's middlewares do for /v1/infer, for the inference lane
        (routing.gateway.lane)."""
        return LaneGuard(app[AUTH], self.broker.metrics.http_requests)


class LaneGuard:
    """routing.gateway.lane's Guard in the broker: for `/v1/infer` on the lane it does what the
    audit,
    errors and auth middlewares do on aiohttp's route (broker.api.access, broker.api.app): the
    caller's token and role (401/403 with the same bodies), the X-Request-Id on every
    answer, and the request counter by (method, route, status)."""

    def __init__(self, access: Access, requests: LoopCounter) -> None:
        self.access = access
        self.requests = requests
        self.permission = ACCESS[("*", INFER_ROUTE)]

    def admit(self, headers: Mapping[bytes, bytes]) -> Admission | Refusal:
        given = headers.get(b"x-request-id")
        ids = ((REQUEST_ID, new_request_id(given.decode("latin-1") if given else "")),)
        access = self.access
        if not access.enabled:
            return Admission(None, ids)
        authorization = headers.get(b"authorization")
        try:
            who = authorize(
                access,
                self.permission,
                authorization.decode("latin-1") if authorization is not None else None,
            )
        except Unauthorized as exc:
            challenge = ("WWW-Authenticate", 'Bearer realm="cpn"')
            return Refusal(401, "unauthorized", str(exc), "Authorization", (*ids, challenge))
        except Forbidden as exc:
            return Refusal(403, "forbidden", str(exc), exc.field, ids)
        return Admission(who.tenant, ids)

    def done(self, method: str, status: int) -> None:
        if status:
            count_request(self.requests, method, INFER_ROUTE, status)


def infer_operation(handle: Handler) -> Operation:
    """`ANY /v1/infer/{service}/{path}` as the OpenAPI document lists it (docs/inference.md)."""
    return Operation(
        "*", "/v1/infer/{service}/{path:.*}", handle,
        "Proxy an inference request to the best site for the client", "infer",
        params=(
            Param("service", "path", "the inference service, e.g. qwen-72b"),
            Param("path", "path", "the path at the site's model server, e.g. v1/completions"),
            Param(REGION_HEADER, "header", "the client region; else the peer address's CIDR"),
            Param(TENANT_HEADER, "header", "the tenant whose rate limit applies (anonymous)"),
            Param(SESSION_HEADER, "header", "keeps a session on one site"),
            Param(SESSION_COOKIE, "cookie", "the session key, when the header is absent"),
            Param(PREFIX_HEADER, "header", "prefix affinity's key (else from the prompt)"),
            Param("Idempotency-Key", "header", "makes a POST safe to retry on another site"),
        ),
        body={"description": "passed through to the site as sent"},
        body_types=(JSON, "text/plain"),
        body_required=False,
        replies={
            "default": Reply(
                "the site's answer, streamed through",
                headers={
                    "X-Cpn-Site": "the site that answered",
                    "X-Cpn-Attempts": "sites tried, this one included",
                    "X-Cpn-Route-Ms": "time spent choosing the site, ms",
                },
            )
        },
        errors=(400, 404, 413, 429, 502, 503, 504),
    )  # fmt: skip
