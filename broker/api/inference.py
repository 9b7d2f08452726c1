"""The broker's inference gateway: `ANY /v1/infer/{service}/{path}` through routing's proxy.

Wires the router (topology + selection over the mirrored registry) to routing.gateway.proxy's
InferenceProxy: the chosen site first, the rest of the ranking after it for retries; passive
ejections feed back into selection; an active checker GETs every endpoint's /healthz.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path

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
from broker.api.openai import openai_operations
from broker.api.openapi import JSON, Operation, Param, Reply, register
from broker.api.tenants import INFERENCE_LIMITS
from broker.model.errors import InvalidRequest, NotFound
from broker.model.tenants import InferencePolicy
from broker.placement.settings import InferenceSettings
from broker.process import RESTART, Broker
from broker.state.auth import Forbidden, Unauthorized
from broker.state.inference_limits import InferenceLimits
from broker.state.metrics import BrokerMetrics, LoopCounter
from broker.state.models import ModelCatalog
from broker.state.router import Router
from broker.state.token_ledger import TokenLedger, TokenLedgerError
from metering.tokens import TokenUse
from routing.decision.candidates import site_replicas
from routing.gateway.health import (
    ActiveHealthChecker,
    HealthCheckSettings,
    OutlierDetector,
)
from routing.gateway.lane import Admission, Refusal
from routing.gateway.prefix import PREFIX_HEADER
from routing.gateway.proxy import (
    PRIORITY_HEADER,
    REGION_HEADER,
    SESSION_COOKIE,
    SESSION_HEADER,
    TENANT_HEADER,
    Billed,
    Extra,
    InferenceProxy,
    Targets,
    UnknownRegion,
    UnknownService,
    Upstream,
    upstream_key,
)
from routing.gateway.ratelimit import RateLimit, TenantLimiter
from routing.gateway.tally import REFRESH_S, Account, Counts, Tally
from routing.gateway.upstream import UpstreamPool
from sites.kits.clock import Clock
from sites.model.errors import ConfigError, Problem
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec, TokenPrice
from sites.model.status import PriceHistory

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
INFER_ROUTE = "/v1/infer/{service}/{path}"  # the route's canonical form, as metrics label it
NO_DOT_SEGMENT = r"^(?!([\s\S]*/)?\.{1,2}(/|(?![\s\S])))"
"""The proxy's path: no '.' or '..' segment (routing.gateway.proxy.has_dot_segment)."""


class Picked(list[Upstream]):
    """Gateway.pick's upstreams; `overflow`: every allowed site is full and the first of them
    was taken anyway (the proxy's queue and alias spill look at it)."""

    overflow = False


class TokenAccountant:
    """The books behind the gateway's compiled accounting (routing.gateway.tally.Tally, the
    proxy's Accountant): the replica's limits (broker.state.inference_limits), its token
    ledger (broker.state.token_ledger) and metrics. The Tally keeps the per-request sums and
    comes here only when they cannot answer: a request beyond its tenant's headroom, an
    account to look up (a new row after each ledger flush, a new day, once a second), a token
    with limits of its own."""

    def __init__(
        self,
        *,
        ledger: TokenLedger,
        limits: InferenceLimits | None,
        metrics: BrokerMetrics,
        snapshot: Callable[[], Snapshot],
        clock: Clock,
    ) -> None:
        self.ledger = ledger
        self.limits = limits
        self.metrics = metrics
        self.snapshot = snapshot
        self.clock = clock
        self.tally = Tally(books=self, clock=clock, file=ledger.file)

    def admit(self, tenant: str, token_id: str | None) -> tuple[int, str, str, str, Extra] | None:
        limits = self.limits
        if limits is None:
            self.tally.gate(tenant, token_id, _UNLIMITED, math.inf)
            return None
        now = self.clock.time()
        refusal = limits.admit(tenant, token_id, now)
        if refusal is None:
            counts = limits.counts(tenant, token_id)
            if counts is None:  # the token's own limits: every request asks them
                self.tally.shut(tenant, token_id)
                return None
            until = self.clock.monotonic() + limits.flush_s
            limits.grant(tenant, counts, now, until, limits.flush_s)
            self.tally.gate(tenant, token_id, counts, until)
            return None
        retry = refusal.retry_after_header
        headers: Extra = (
            (("Retry-After", retry),)
            if refusal.should_retry and retry is not None
            else (("x-should-retry", "false"),)
        )
        return refusal.status, refusal.code, refusal.message, refusal.field, headers

    def account(self, billed: Billed, at: float) -> Account:
        model = self._served_model(billed.service, billed.site)
        use = TokenUse(
            request_id=billed.request_id,
            tenant=billed.tenant,
            token_id=billed.token_id,
            model=model,
            requested=billed.requested,
            service=billed.service,
            site=billed.site,
            client_region=billed.region,
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            at=at,
        )
        ledger = self.ledger
        price = ledger.price_of(use)
        per_token = 1e-6
        if price is None:
            rates = (0.0, 0.0, 0.0)
        else:
            cached = price.input if price.cached_input is None else price.cached_input
            rates = (price.input * per_token, price.output * per_token, cached * per_token)
        limits = self.limits
        counts = _UNLIMITED if limits is None else limits.counts(billed.tenant, billed.token_id)
        day_end = (at // 86400 + 1) * 86400
        return Account(
            row=ledger.row(use),
            input_usd=rates[0],
            output_usd=rates[1],
            cached_usd=rates[2],
            metric=self.metrics.inference.row(billed.tenant, model, billed.site),
            counts=counts,
            template=ledger.template(use),
            until=min(day_end, at + REFRESH_S),
        )

    def charge(self, tenant: str, token_id: str | None, tokens: int, usd: float, at: float) -> None:
        if self.limits is not None:
            self.limits.charge(tenant, token_id, tokens=tokens, usd=usd, now=at)

    def _served_model(self, service: str, site: str) -> str:
        """The model `service` serves at `site` (its endpoint's), what prices are keyed by."""
        ep = self.snapshot().services.get((service, site))
        return ep.model if ep is not None else service


_UNLIMITED = Counts()  # metering without limits: admitted, nothing counted
_UNLIMITED.grant(False, math.inf, 0, 0, 0.0)


def token_price(snapshot: Callable[[], Snapshot]) -> Callable[[str, str, float], TokenPrice | None]:
    """(site, model, unix s) -> the site's token price for the model in force then: from its
    price history (sites.model.status.PriceHistory), else its spec."""

    # (site, model) -> (the history and spec it was read from, since when, the price): the
    # price of the latest change, for requests that end after it (all, but a recovered one)
    latest: dict[tuple[str, str], tuple[object, object, float, TokenPrice | None]] = {}

    def price(site: str, model: str, at: float) -> TokenPrice | None:
        snap = snapshot()
        history = snap.price_history.get(site)
        spec = snap.specs.get(site)
        kept = latest.get((site, model))
        if kept is not None and kept[0] is history and kept[1] is spec and at >= kept[2]:
            return kept[3]
        found = _price_then(history, spec, model, at)
        if history is None or not history.changes or at >= history.changes[-1].since:
            if len(latest) >= 4096:
                latest.clear()
            since = history.changes[-1].since if history is not None and history.changes else 0.0
            latest[(site, model)] = (history, spec, since, found)
        return found

    return price


def _price_then(
    history: PriceHistory | None, spec: SiteSpec | None, model: str, at: float
) -> TokenPrice | None:
    if history is not None:
        for change in reversed(history.changes):
            if change.since <= at:
                return change.prices.token_price(model)
    return spec.prices.token_price(model) if spec is not None else None


class Gateway:
    """Owns the proxy (and its upstream connections), the health checker, the model catalog,
    and with metering on the token ledger and limits; `install(app)` adds the routes."""

    def __init__(
        self,
        *,
        broker: Broker,
        router: Router,
        settings: InferenceSettings | None = None,
        client_source_ips: dict[str, str] | None = None,
        site_keys: Mapping[tuple[str, str], str] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        """`site_keys`: the keys of broker.placement.settings.read_site_keys, for the proxy.
        `state_dir`: where the token ledger writes ahead (its file, and the replica's id that
        keeps its records its own across restarts); required with metering on."""
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
        region = self.settings.client_region
        if region is not None and region not in router.clients:
            raise ConfigError(
                [Problem("broker.yaml", "inference.client_region", f"no client region {region!r}")]
            )
        self.catalog = ModelCatalog(
            snapshot=lambda: router.snapshot,
            job_tenant=self._job_tenant,
            aliases=self.settings.aliases,
        )
        self.state_dir = state_dir
        self.scoped = False  # auth on: a tenant sees its own managed services only
        self.app: web.Application | None = None
        self.ledger: TokenLedger | None = None
        self.limits: InferenceLimits | None = None
        self.accountant: TokenAccountant | None = None

    def _job_tenant(self, job: str) -> str | None:
        found = self.broker.view().jobs.get(job)
        return found[0].spec.tenant if found is not None else None

    def _default_priority(self, tenant: str) -> int:
        policy = self.broker.tenancy.file.tenants.get(tenant)
        inference = policy.inference if policy is not None else None
        return inference.priority if inference is not None else 0

    def _inference_policy(self, tenant: str) -> InferencePolicy | None:
        policy = self.broker.tenancy.file.tenants.get(tenant)
        return policy.inference if policy is not None else None

    def resolve(self, model: str, tenant: str) -> Targets | None:
        """The proxy's resolve_model: with auth off every model is everyone's."""
        scoped = tenant if self.scoped else None
        return self.catalog.resolve(model, scoped)

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
        picked = Picked(
            Upstream(site, url, source, replica=site in several) for site, url in chosen.upstreams
        )
        if chosen.overflow:
            picked.overflow = True
        return picked

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
            self.scoped = app[AUTH].enabled
            self.app = app
            if settings.metering:  # first: a state directory it cannot use stops the start
                await self._start_metering()
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
                resolve_model=self.resolve,
                served_name=self.catalog.served_name,
                default_region=settings.client_region,
                accountant=self.accountant.tally if self.accountant is not None else None,
                default_priority=self._default_priority,
                pass_priority=frozenset(settings.pass_priority),
                queue_timeout_s=settings.queue.timeout_s,
            )
            yield
            await self.broker.supervisor.cancel("health checker")
            await self.proxy.close()
            await self._session.close()
            await self._stop_metering()

        app.cleanup_ctx.append(lifetime)

        async def handle(request: web.Request) -> web.StreamResponse:
            if self.proxy is None:
                raise web.HTTPServiceUnavailable()
            return await self.proxy.handle(request)

        register(app, infer_operation(handle))
        for operation in openai_operations(handle, self.catalog):
            register(app, operation)

    async def _start_metering(self) -> None:
        broker = self.broker
        state_dir = self.state_dir
        if state_dir is None:
            raise RuntimeError("the token ledger needs a state directory (cpn broker --state-dir)")
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            writer = TokenLedger.writer_id(state_dir)
            self.ledger = TokenLedger(
                registry=broker.registry,
                writer=writer,
                state_dir=state_dir,
                price=token_price(lambda: broker.view().sites),
                clock=broker.clock,
            )
        except (TokenLedgerError, OSError) as exc:  # another broker's, or not writable
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError([Problem(str(state_dir), "--state-dir", reason)]) from None
        self.limits = InferenceLimits(
            registry=broker.registry,
            writer=writer,
            policy=self._inference_policy,
            token_limits=broker.tokens.limits,
            clock=broker.clock,
        )
        self.accountant = TokenAccountant(
            ledger=self.ledger,
            limits=self.limits,
            metrics=broker.metrics,
            snapshot=lambda: self.router.snapshot,
            clock=broker.clock,
        )
        # supervised: a crash shows in /healthz, then restarts; the ledger recovers what a
        # killed broker had written ahead before it flushes anything new
        if self.app is not None:  # cpn tenants: what all replicas used of the limits
            self.app[INFERENCE_LIMITS] = self.limits
        broker.supervisor.spawn("token ledger", self._run_ledger, restart=RESTART)
        broker.supervisor.spawn("inference limits", self.limits.run, restart=RESTART)

    async def _run_ledger(self) -> None:
        """The ledger's loop once the registry was read: what it recovers is priced at the
        sites' prices, which come with the view."""
        await self.broker.views.mirror.synced.wait()
        if self.ledger is not None:
            await self.ledger.run()

    async def _stop_metering(self) -> None:
        for name in ("token ledger", "inference limits"):
            await self.broker.supervisor.cancel(name)
        if self.ledger is not None:
            await self.ledger.close()

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
            return Admission(None, ids, None, ids[0][1])
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
        return Admission(who.tenant, ids, who.token_id, ids[0][1])

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
            Param(
                "path", "path",
                "the path at the site's model server, e.g. v1/completions; no '.' or '..' "
                "segment (the site would resolve it outside the service)",
                {"type": "string", "pattern": NO_DOT_SEGMENT},
            ),
            Param(
                REGION_HEADER, "header",
                "the client region (the document lists the broker's); else the peer address's "
                "CIDR",
            ),
            Param(TENANT_HEADER, "header", "the tenant whose rate limit applies (anonymous)"),
            Param(SESSION_HEADER, "header", "keeps a session on one site"),
            Param(SESSION_COOKIE, "cookie", "the session key, when the header is absent"),
            Param(PREFIX_HEADER, "header", "prefix affinity's key (else from the prompt)"),
            Param(
                PRIORITY_HEADER, "header",
                "the request's priority, higher first; negative is shed first when every site "
                "is saturated (default: its tenant's)",
                {"type": "integer"},
            ),
            Param("Idempotency-Key", "header", "makes a POST safe to retry on another site"),
        ),
        body={
            "description": "passed through to the site as sent, at most inference."
            "max_body_bytes (broker.yaml; else a 413)"
        },
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
