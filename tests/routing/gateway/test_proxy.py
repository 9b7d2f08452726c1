"""routing.gateway.proxy, routing.gateway.health, routing.gateway.ratelimit: the inference proxy
end to end on loopback.

Upstreams are real HTTP servers on 127.0.0.1: the stand-in model server, and small purpose-built
apps where a test needs an upstream that misbehaves in one exact way. FakeClock drives
ejections and rate limits; streaming is measured on the real clock.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from routing.gateway.health import (
    ActiveHealthChecker,
    HealthBook,
    HealthCheckSettings,
    OutlierDetector,
    OutlierSettings,
)
from routing.gateway.lane_site import LaneSite
from routing.gateway.proxy import (
    Failure,
    InferenceProxy,
    UnknownService,
    Upstream,
    add_routes,
    may_retry,
    upstream_key,
)
from routing.gateway.ratelimit import RateLimit, TenantLimiter, TokenBucket
from routing.standin.server import ModelServerSettings, make_app
from sites.kits.tasks import Supervisor
from tests.conftest import wait_for

Serve = Callable[[web.Application], Awaitable[str]]


class FakeClock:
    """Virtual time for ejections and rate limits (the proxy reads no other time)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@dataclass
class Echo:
    """An upstream that answers every path with what it got; `statuses` scripts its answers."""

    name: str
    statuses: list[int] = field(default_factory=list)
    delay_s: float = 0.0
    hits: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.hits.append(
            {
                "method": request.method,
                "raw_path": request.raw_path,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        status = self.statuses.pop(0) if self.statuses else 200
        return web.json_response(
            {"site": self.name}, status=status, headers={"X-Up": self.name, "Keep-Alive": "x"}
        )


def dead_url() -> str:
    """A loopback port nobody listens on: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class Harness:
    url: str
    proxy: InferenceProxy
    detector: OutlierDetector
    picks: list[tuple[str, str | None, str | None]]

    def infer_url(self, tail: str = "v1/completions", service: str = "llm") -> str:
        return f"{self.url}/v1/infer/{service}/{tail}"


MakeProxy = Callable[..., Awaitable[Harness]]


ServeProxy = Callable[[web.Application, InferenceProxy], Awaitable[str]]


@pytest.fixture(params=["aiohttp", "lane"])
async def serve_proxy(request: pytest.FixtureRequest) -> AsyncIterator[ServeProxy]:
    """The proxy's app served as the broker serves it: through aiohttp's server alone, or
    with routing.gateway.lane in front (every proxy test runs on both)."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application, proxy: InferenceProxy) -> str:
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        if request.param == "lane":
            site: web.TCPSite = LaneSite(runner, "127.0.0.1", 0, proxy=lambda: proxy, drain_s=0.5)
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
async def make_proxy(serve_proxy: ServeProxy) -> AsyncIterator[MakeProxy]:
    sessions: list[aiohttp.ClientSession] = []

    async def make(
        candidates: Sequence[Upstream],
        *,
        services: Sequence[str] = ("llm",),
        outlier: OutlierSettings | None = None,
        **options: Any,
    ) -> Harness:
        picks: list[tuple[str, str | None, str | None]] = []

        async def pick(service: str, region: str | None, key: str | None) -> list[Upstream]:
            picks.append((service, region, key))
            return list(candidates) if service in services else []

        session = aiohttp.ClientSession()
        sessions.append(session)
        detector = OutlierDetector(settings=outlier)
        settings: dict[str, Any] = {
            "limiter": None,
            "connect_timeout_s": 1.0,
            "response_timeout_s": 2.0,
            "max_attempts": 3,
            "max_body_bytes": 4096,
            "known_services": lambda: services,
            **options,
        }
        proxy = InferenceProxy(pick=pick, health=detector, session=session, **settings)
        app = web.Application()
        add_routes(app, proxy)
        return Harness(await serve_proxy(app, proxy), proxy, detector, picks)

    yield make
    for session in sessions:
        await session.close()


async def standin(serve: Serve, name: str, **fields: Any) -> Upstream:
    values: dict[str, Any] = {
        "name": name,
        "median_ms": 5,
        "p99_ms": 5,
        "max_concurrency": 4,
        **fields,
    }
    return Upstream(name, await serve(make_app(ModelServerSettings(**values))))


async def echo(serve: Serve, name: str, **fields: Any) -> tuple[Upstream, Echo]:
    upstream = Echo(name, **fields)
    return Upstream(name, await serve(upstream.app())), upstream


REGION = {"X-Cpn-Client-Region": "beijing"}


# --- pure parts ------------------------------------------------------------------------------


def test_retry_table() -> None:
    for failure in Failure:
        assert may_retry(failure, idempotent=True)
    retried_without_idempotency = {f for f in Failure if may_retry(f, idempotent=False)}
    assert retried_without_idempotency == {Failure.not_sent, Failure.busy, Failure.key_refused}


def test_outlier_ejects_after_consecutive_failures_only() -> None:
    d = OutlierDetector(settings=OutlierSettings(consecutive_failures=3, base_ejection_time_s=10))
    assert not d.report("a", False, 0) and not d.report("a", False, 1)
    d.report("a", True, 2)  # a success breaks the run
    assert not d.report("a", False, 3) and not d.report("a", False, 4)
    assert not d.is_ejected("a", 4)
    assert d.report("a", False, 5)
    assert d.is_ejected("a", 5) and d.ejected_until("a", 5) == 15
    assert d.ejections(6) == {"a": 15}
    assert not d.report("a", False, 6)  # in flight before the ejection: ignored
    assert d.ejected_until("a", 14.9) == 15
    assert not d.is_ejected("a", 15)
    assert d.state("a", 15).consecutive_failures == 0


def test_outlier_ejection_time_grows_then_caps_then_decays() -> None:
    settings = OutlierSettings(
        consecutive_failures=1, base_ejection_time_s=10, max_ejection_time_s=25
    )
    d = OutlierDetector(settings=settings)
    d.report("a", False, 0)
    assert d.ejected_until("a", 0) == 10  # 1 x base
    d.report("a", False, 10)
    assert d.ejected_until("a", 10) == 30  # 2 x base
    d.report("a", False, 30)
    assert d.ejected_until("a", 30) == 55  # 3 x base = 30, capped at 25
    assert d.state("a", 55).times_ejected == 3
    # Healthy for two base times after the ejection: the multiplier drops by two.
    assert d.state("a", 75).times_ejected == 1
    d.report("a", False, 75)
    assert d.ejected_until("a", 75) == 95  # 2 x base again
    assert d.state("z", 0).times_ejected == 0


def test_outlier_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_ejection_time_s"):
        OutlierSettings(base_ejection_time_s=60, max_ejection_time_s=30)


def test_health_book_needs_n_results_in_a_row() -> None:
    book = HealthBook(healthy_threshold=2, unhealthy_threshold=3)
    assert book.is_healthy("a")  # unknown: initially healthy
    assert not book.record("a", False, 1, "HTTP 500")
    assert not book.record("a", False, 2, "HTTP 500")
    assert book.record("a", False, 3, "HTTP 500")
    assert not book.is_healthy("a")
    assert not book.record("a", True, 4)
    assert not book.record("a", False, 5, "timeout")  # the run of passes restarts
    assert not book.record("a", True, 6)
    assert book.record("a", True, 7)
    (state,) = book.states()
    assert state.healthy and state.changed_at == 7 and state.error is None
    book.retain([])
    assert book.states() == []
    assert not HealthBook(initially_healthy=False).is_healthy("new")


def test_token_bucket_bursts_then_refills() -> None:
    limit = RateLimit(rate_per_s=2, burst=3)
    limiter = TenantLimiter(default=limit, overrides={"gold": RateLimit(rate_per_s=100, burst=100)})
    assert [limiter.acquire("t", 0).allowed for _ in range(4)] == [True, True, True, False]
    assert limiter.acquire("t", 0).retry_after_s == pytest.approx(0.5)
    assert limiter.acquire("t", 0.25).retry_after_s == pytest.approx(0.25)
    assert limiter.acquire("t", 0.5).allowed
    assert limiter.acquire("gold", 0).allowed and limiter.acquire("other", 0).allowed
    assert limiter.tokens("t", 100) == 3  # never above the burst
    bucket, decision = TokenBucket(0, 10).take(limit, 5)  # a clock that stepped back
    assert not decision.allowed and bucket.tokens == 0
    with pytest.raises(ValueError, match="rate_per_s"):
        RateLimit(rate_per_s=0, burst=1)


def test_limiter_forgets_full_buckets_past_max_tenants() -> None:
    limiter = TenantLimiter(default=RateLimit(rate_per_s=1, burst=1), max_tenants=2)
    for i in range(5):
        limiter.acquire(f"t{i}", 0)
    limiter.acquire("late", 10)  # by now every earlier bucket is full again
    assert limiter.tokens("t0", 10) == 1
    assert len(limiter._buckets) <= 2


# --- proxy: routing, headers, pass-through ---------------------------------------------------


async def test_routes_to_the_first_candidate_and_names_it(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    a, b = await standin(serve, "site-a"), await standin(serve, "site-b")
    h = await make_proxy([a, b])
    async with http.post(h.infer_url(), json={"prompt": "hi"}, headers=REGION) as resp:
        assert resp.status == 200
        body = await resp.json()
        assert resp.headers["X-Cpn-Site"] == "site-a"
        assert resp.headers["X-Cpn-Attempts"] == "1"
        assert float(resp.headers["X-Cpn-Route-Ms"]) >= 0
        assert resp.headers["X-Cpn-Standin"] == "1"  # upstream headers are copied
    assert body["model"] == "site-a"
    assert h.picks == [("llm", "beijing", None)]


async def test_forwards_path_query_and_end_to_end_headers_only(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    up, upstream = await echo(serve, "a")
    h = await make_proxy([up])
    headers = {**REGION, "X-Custom": "1", "Connection": "keep-alive, X-Drop", "X-Drop": "1"}
    async with http.put(
        URL(h.infer_url("v2/models/a%20b/infer?x=1&y=%2F"), encoded=True),
        data=b"payload",
        headers=headers,
    ) as resp:
        assert resp.status == 200
        assert resp.headers["X-Up"] == "a"
        assert "Keep-Alive" not in resp.headers  # hop-by-hop stays on its hop
    (hit,) = upstream.hits
    assert hit["method"] == "PUT"
    assert hit["raw_path"] == "/v2/models/a%20b/infer?x=1&y=%2F"
    assert hit["body"] == b"payload"
    assert hit["headers"]["X-Custom"] == "1"
    assert "X-Drop" not in hit["headers"]
    assert hit["headers"]["X-Forwarded-For"] == "127.0.0.1"
    assert hit["headers"]["Host"] == up.base_url.removeprefix("http://")


async def test_a_gateways_client_credentials_stay_with_the_gateway(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """With drop_credentials (the broker's gateway, whose clients send their cpn token) the
    site never sees the Authorization header; a plain proxy passes it on."""
    up, upstream = await echo(serve, "a")
    headers = {**REGION, "Authorization": "Bearer cpn_0123456789abcdef_secret", "X-Custom": "1"}
    for drop in (True, False):
        h = await make_proxy([up], drop_credentials=drop)
        async with http.post(h.infer_url(), data=b"{}", headers=headers) as resp:
            assert resp.status == 200
        hit = upstream.hits[-1]
        assert hit["headers"]["X-Custom"] == "1"
        assert ("Authorization" in hit["headers"]) is not drop


async def test_a_sites_own_key_replaces_the_clients_authorization(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """site_keys: a site that requires a key gets `Authorization: Bearer <its key>` (the
    service's own over the site's "*"), never the client's header; a site without one gets
    what it got before. Per attempt: a retry from a keyed site to another carries that one's."""
    up_a, a = await echo(serve, "a")
    up_b, b = await echo(serve, "b")
    client = {**REGION, "Authorization": "Bearer cpn_0123456789abcdef_secret"}
    for drop in (True, False):
        h = await make_proxy([up_a], drop_credentials=drop, site_keys={("a", "*"): "sk-a"})
        async with http.post(h.infer_url(), data=b"{}", headers=client) as resp:
            assert resp.status == 200
        assert a.hits[-1]["headers"]["Authorization"] == "Bearer sk-a"
    keys = {("a", "*"): "sk-any", ("a", "llm"): "sk-llm", ("b", "other"): "sk-b"}
    h = await make_proxy([up_a, up_b], site_keys=keys)
    a.statuses = [429]  # a turns it away, the proxy tries b
    async with http.post(h.infer_url(), data=b"{}", headers=client) as resp:
        assert resp.status == 200 and resp.headers["X-Cpn-Site"] == "b"
    assert a.hits[-1]["headers"]["Authorization"] == "Bearer sk-llm"
    assert b.hits[-1]["headers"]["Authorization"] == client["Authorization"]  # none for llm


async def test_a_site_that_refuses_its_key_is_tried_elsewhere_and_named(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """A 401/403 to the site's own key did no work: the next site is tried (a POST too), the
    site counts a failure (ejected after enough), and when no site is left the client gets a
    502 naming the key, not the site's 401 (its own credentials were fine). A site without a
    key keeps its 401 as the client's answer."""
    up_a, a = await echo(serve, "a")
    up_b, b = await echo(serve, "b")
    h = await make_proxy([up_a, up_b], site_keys={("a", "*"): "sk-old"})
    a.statuses = [401]
    async with http.post(h.infer_url(), data=b"{}", headers=REGION) as resp:
        assert resp.status == 200 and resp.headers["X-Cpn-Site"] == "b"
        assert resp.headers["X-Cpn-Attempts"] == "2"
    assert h.detector.state(upstream_key("llm", up_a), 0.0).consecutive_failures == 1
    h = await make_proxy([up_a], site_keys={("a", "*"): "sk-old"})
    a.statuses = [403]
    async with http.post(h.infer_url(), data=b"{}", headers=REGION) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["code"] == "upstream_key_refused"
    assert "'a'" in error["message"] and "key" in error["message"]
    b.statuses = [401]
    h = await make_proxy([up_b], site_keys={("a", "*"): "sk-old"})
    async with http.post(h.infer_url(), data=b"{}", headers=REGION) as resp:
        assert resp.status == 401  # the site's own answer to the client's request


async def test_session_key_from_header_or_cookie_reaches_pick(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    up, _ = await echo(serve, "a")
    h = await make_proxy([up])
    await http.get(h.infer_url("x"), headers={**REGION, "X-Cpn-Session": "s1"})
    await http.get(h.infer_url("x"), headers={**REGION, "Cookie": "cpn-session=s2"})
    assert [p[2] for p in h.picks] == ["s1", "s2"]


# --- proxy: retries --------------------------------------------------------------------------


async def test_post_goes_to_the_next_site_when_the_connection_is_refused(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    dead = Upstream("dead", dead_url())
    b = await standin(serve, "site-b")
    h = await make_proxy([dead, b])
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 200
        assert resp.headers["X-Cpn-Site"] == "site-b"
        assert resp.headers["X-Cpn-Attempts"] == "2"
    # a refused connection ejects at once (nothing listens there): the next request skips it
    assert h.detector.state(upstream_key("llm", dead), 0).times_ejected == 1


async def test_post_is_not_retried_after_a_500(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    a, ea = await echo(serve, "a", statuses=[500])
    b, eb = await echo(serve, "b")
    h = await make_proxy([a, b])
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 500  # the upstream's answer, passed through
        assert resp.headers["X-Cpn-Site"] == "a"
        assert resp.headers["X-Cpn-Attempts"] == "1"
    assert (len(ea.hits), len(eb.hits)) == (1, 0)


@pytest.mark.parametrize(
    ("method", "extra"),
    [("POST", {"Idempotency-Key": "k-1"}), ("GET", {}), ("DELETE", {})],
)
async def test_idempotent_request_is_retried_after_a_500(
    serve: Serve,
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
    method: str,
    extra: dict[str, str],
) -> None:
    a, ea = await echo(serve, "a", statuses=[500])
    b, eb = await echo(serve, "b")
    h = await make_proxy([a, b])
    async with http.request(method, h.infer_url(), headers={**REGION, **extra}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Cpn-Site"] == "b"
        assert resp.headers["X-Cpn-Attempts"] == "2"
    assert (len(ea.hits), len(eb.hits)) == (1, 1)
    if extra:
        assert eb.hits[0]["headers"]["Idempotency-Key"] == "k-1"


async def test_response_timeout_retries_get_but_not_post(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    slow, _ = await echo(serve, "slow", delay_s=1.0)
    fast, _ = await echo(serve, "fast")
    h = await make_proxy([slow, fast], response_timeout_s=0.2)
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_timeout"
        assert resp.headers["X-Cpn-Site"] == "slow"
    async with http.get(h.infer_url(), headers=REGION) as resp:
        assert resp.status == 200
        assert resp.headers["X-Cpn-Site"] == "fast"


async def test_upstream_429_goes_to_the_next_site_without_counting_as_failure(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    full, _ = await echo(serve, "full", statuses=[429])
    b, _ = await echo(serve, "b")
    h = await make_proxy([full, b])
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 200 and resp.headers["X-Cpn-Site"] == "b"
    assert h.detector.state(upstream_key("llm", full), 0).consecutive_failures == 0


async def test_attempts_are_capped_and_unreachable_is_a_502(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    dead = [Upstream(f"d{i}", dead_url()) for i in range(3)]
    h = await make_proxy(dead, max_attempts=2)
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_unreachable"
        assert resp.headers["X-Cpn-Attempts"] == "2"
        assert resp.headers["X-Cpn-Site"] == "d1"


async def test_each_answered_request_is_observed_once_by_region_and_site(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The broker's cpn_proxy_request_duration_seconds hook: (region, site answering, seconds),
    the site that answered after retries; a request no site saw is not observed."""
    seen: list[tuple[str, str, float]] = []
    a = await standin(serve, "site-a")
    h = await make_proxy([Upstream("dead", dead_url()), a], observe=lambda *args: seen.append(args))
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 200
    async with http.post(h.infer_url(service="nope"), json={}, headers=REGION) as resp:
        assert resp.status == 404
    assert [(region, site) for region, site, _ in seen] == [("beijing", "site-a")]
    assert 0 < seen[0][2] < 5


@dataclass
class Sink:
    """The autoscaler's counters as the proxy feeds them (broker.state.traffic.TrafficBook's
    calls)."""

    requests: list[tuple[str, str]] = field(default_factory=list)
    first_bytes: list[tuple[str, str, float]] = field(default_factory=list)

    def request(self, service: str, region: str) -> None:
        self.requests.append((service, region))

    def first_byte(self, service: str, region: str, seconds: float) -> None:
        self.first_bytes.append((service, region, seconds))


async def test_requests_and_their_first_byte_are_counted_per_service_and_region(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """Every request for a known service counts as demand (answered or not); its time to the
    first byte the client gets is recorded once, for a stream at its first event."""
    sink = Sink()
    ends: list[tuple[str, str, float]] = []
    a = await standin(serve, "site-a", median_ms=50, p99_ms=50, tokens=8)
    h = await make_proxy([a], traffic=sink, observe=lambda *args: ends.append(args))
    async with http.post(h.infer_url(), json={"prompt": "x"}, headers=REGION) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.post(
        h.infer_url(), json={"prompt": "x", "stream": True}, headers=REGION
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.post(h.infer_url(service="nope"), json={}, headers=REGION) as resp:
        assert resp.status == 404  # an unknown service is nobody's demand
    assert sink.requests == [("llm", "beijing"), ("llm", "beijing")]
    assert [(svc, region) for svc, region, _ in sink.first_bytes] == [("llm", "beijing")] * 2
    whole, streamed = sink.first_bytes[0][2], sink.first_bytes[1][2]
    assert 0 < whole <= ends[0][2]
    assert 0 < streamed < ends[1][2]  # the first event, before the stream's end
    # a known service nobody can serve now: demand all the same, no first byte
    empty = await make_proxy([], traffic=sink)
    async with http.post(empty.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 503
    assert len(sink.requests) == 3 and len(sink.first_bytes) == 2


# --- proxy: ejection and health checks -------------------------------------------------------


async def test_failing_site_is_ejected_for_a_growing_time(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    clock = FakeClock()
    dead = Upstream("dead", dead_url())
    b, _ = await echo(serve, "b")
    outlier = OutlierSettings(
        consecutive_failures=2, consecutive_connect_failures=2, base_ejection_time_s=10
    )
    h = await make_proxy([dead, b], outlier=outlier, clock=clock)
    key = upstream_key("llm", dead)

    async def attempts() -> str:
        async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
            assert resp.status == 200 and resp.headers["X-Cpn-Site"] == "b"
            return resp.headers["X-Cpn-Attempts"]

    assert [await attempts(), await attempts()] == ["2", "2"]
    assert h.detector.ejected_until(key, clock.now) == clock.now + 10
    ejected = h.proxy.ejected_sites("llm", clock.now)
    assert ejected == {"dead": clock.now + 10} and len(ejected) == 1
    assert "dead" in ejected and "b" not in ejected and ejected.get("b") is None
    assert h.proxy.ejected_sites("other", clock.now) == {}  # per service
    assert await attempts() == "1"  # skipped while ejected
    clock.advance(10)
    assert [await attempts(), await attempts()] == ["2", "2"]  # tried again, fails twice more
    assert h.detector.ejected_until(key, clock.now) == clock.now + 20  # second ejection: 2 x
    clock.advance(19)
    assert await attempts() == "1"


async def test_a_failing_replica_is_ejected_alone_not_its_site(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """One of a site's several replicas fails: its own key ("service@site#url") is ejected,
    the site stays routable (not in ejected_sites) and its other replica usable."""
    clock = FakeClock()
    dead = Upstream("a", dead_url(), replica=True)
    alive, _ = await echo(serve, "a")
    alive = alive._replace(replica=True)
    outlier = OutlierSettings(
        consecutive_failures=2, consecutive_connect_failures=2, base_ejection_time_s=10
    )
    h = await make_proxy([dead, alive], outlier=outlier, clock=clock)
    for _ in range(2):
        async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
            assert resp.status == 200 and resp.headers["X-Cpn-Attempts"] == "2"
    assert upstream_key("llm", dead) == f"llm@a#{dead.base_url}"
    assert h.detector.ejected_until(upstream_key("llm", dead), clock.now) == clock.now + 10
    assert h.proxy.ejected_sites("llm", clock.now) == {}  # the site is not ejected
    assert not h.proxy.replica_usable("llm", "a", dead.base_url, clock.now)
    assert h.proxy.replica_usable("llm", "a", alive.base_url, clock.now)
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.headers["X-Cpn-Attempts"] == "1"  # the ejected replica is skipped


async def test_all_candidates_ejected_is_503_no_capacity(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    clock = FakeClock()
    dead = Upstream("dead", dead_url())
    h = await make_proxy([dead], outlier=OutlierSettings(consecutive_failures=1), clock=clock)
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 502
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 503
        error = (await resp.json())["error"]
        assert error["code"] == "no_capacity" and "dead" in error["message"]
        assert resp.headers["X-Cpn-Attempts"] == "0"


async def test_active_health_checks_take_a_site_out_and_back(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    a, b = await standin(serve, "site-a"), await standin(serve, "site-b")
    targets = {upstream_key("llm", u): u.base_url + "/healthz" for u in (a, b)}
    settings = HealthCheckSettings(
        interval_s=0.05, timeout_s=0.5, healthy_threshold=1, unhealthy_threshold=2
    )
    checker = ActiveHealthChecker(targets=lambda: targets, session=http, settings=settings)
    h = await make_proxy([a, b], active=checker)

    async def site() -> str:
        async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
            assert resp.status == 200
            return resp.headers["X-Cpn-Site"]

    await http.post(a.base_url + "/admin/fail", json={"mode": "500"})
    await checker.check_once()
    assert checker.is_healthy(upstream_key("llm", a))  # one failure is not enough
    await checker.check_once()
    states = {s.key: s for s in checker.states()}
    assert not states["llm@site-a"].healthy and states["llm@site-a"].error == "HTTP 500"
    assert states["llm@site-b"].healthy
    assert await site() == "site-b"

    await http.post(a.base_url + "/admin/fail", json={"mode": "ok"})
    supervisor = Supervisor(owner="test")
    supervisor.spawn("health checker", checker.run)
    try:
        await wait_for(lambda: checker.is_healthy("llm@site-a"), timeout=5)
    finally:
        await supervisor.stop()
    assert await site() == "site-a"


async def test_health_checker_marks_a_dead_or_hung_target_unhealthy(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    hung = await standin(serve, "hung")
    await http.post(hung.base_url + "/admin/fail", json={"mode": "hang"})
    targets = {"dead": dead_url() + "/healthz", "hung": hung.base_url + "/healthz"}
    settings = HealthCheckSettings(timeout_s=0.2, unhealthy_threshold=1)
    checker = ActiveHealthChecker(targets=lambda: targets, session=http, settings=settings)
    await checker.check_once()
    states = {s.key: s for s in checker.states()}
    assert not states["dead"].healthy and "Connect" in (states["dead"].error or "")
    assert not states["hung"].healthy and "no answer" in (states["hung"].error or "")
    await http.post(hung.base_url + "/admin/fail", json={"mode": "ok"})


# --- proxy: streaming ------------------------------------------------------------------------


async def test_sse_passes_through_unbuffered(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    # 4 tokens over 1.2 s: the stand-in writes one event every 300 ms.
    up = await standin(serve, "site-a", median_ms=1200, p99_ms=1200, tokens=4)
    h = await make_proxy([up])
    started = time.perf_counter()
    arrivals: list[tuple[float, bytes]] = []
    async with http.post(h.infer_url(), json={"stream": True}, headers=REGION) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Cpn-Site"] == "site-a"
        async for chunk in resp.content.iter_any():
            arrivals.append((time.perf_counter() - started, chunk))
    data = b"".join(c for _, c in arrivals)
    assert data.count(b"data: ") == 5 and data.endswith(b"data: [DONE]\n\n")
    first_at, last_at = arrivals[0][0], arrivals[-1][0]
    assert first_at < 0.7  # the first event, not the whole stream (which takes 1.2 s)
    assert last_at > 1.1
    assert last_at - first_at > 0.6
    assert len(arrivals) >= 4  # arrived as separate pieces


async def test_stream_broken_midway_is_cut_not_completed(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    async def breaks(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await asyncio.sleep(0.05)
        if request.transport is not None:
            request.transport.close()  # dies mid-stream
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", breaks)
    up = Upstream("flaky", await serve(app))
    ok, eok = await echo(serve, "ok")
    h = await make_proxy([up, ok])
    async with http.post(
        h.infer_url(), json={}, headers={**REGION, "Idempotency-Key": "k"}
    ) as resp:
        assert resp.status == 200 and resp.headers["X-Cpn-Site"] == "flaky"
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert eok.hits == []  # bytes had gone out: never retried
    await wait_for(lambda: h.detector.state("llm@flaky", 0).consecutive_failures == 1, timeout=2)


# --- proxy: bad input ------------------------------------------------------------------------


async def test_missing_or_unknown_region_is_a_400(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    up, _ = await echo(serve, "a")
    h = await make_proxy([up], known_regions=lambda: {"beijing"})
    cases = [({}, "missing_region"), ({"X-Cpn-Client-Region": "mars"}, "unknown_region")]
    for headers, code in cases:
        async with http.post(h.infer_url(), json={}, headers=headers) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert (error["code"], error["field"]) == (code, "X-Cpn-Client-Region")
    assert h.picks == []


async def test_a_path_with_dot_segments_is_a_400_and_never_reaches_a_site(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """A site would resolve `..` to another path than the one routed (another service's, or
    none of the model server's API): refused, encoded or not; a dot inside a name is fine."""
    up, upstream = await echo(serve, "a")
    h = await make_proxy([up])
    for tail in ("v1/../../admin", "v1/%2e%2E/x", "./v1/chat", "v1/%2E"):
        async with http.post(URL(h.infer_url(tail), encoded=True), json={}, headers=REGION) as resp:
            assert resp.status == 400, tail
            error = (await resp.json())["error"]
        assert (error["code"], error["field"]) == ("invalid_path", "path")
    assert upstream.hits == [] and h.picks == []
    async with http.post(
        URL(h.infer_url("v1/model.v2/..x?q=../a"), encoded=True), json={}, headers=REGION
    ) as resp:
        assert resp.status == 200
    assert [hit["raw_path"] for hit in upstream.hits] == ["/v1/model.v2/..x?q=../a"]


async def test_region_from_the_peer_address_when_no_header(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    up, _ = await echo(serve, "a")
    h = await make_proxy([up], resolve_region=lambda addr: "local" if addr == "127.0.0.1" else None)
    async with http.get(h.infer_url()) as resp:
        assert resp.status == 200
    assert h.picks == [("llm", "local", None)]


async def test_unknown_service_is_a_404(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    up, _ = await echo(serve, "a")
    h = await make_proxy([up], services=("llm",))
    async with http.post(h.infer_url(service="nope"), json={}, headers=REGION) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert (error["code"], error["field"]) == ("unknown_service", "service")


async def test_pick_may_raise_unknown_service(
    make_proxy: MakeProxy, serve: Serve, http: aiohttp.ClientSession
) -> None:
    async def pick(service: str, region: str | None, key: str | None) -> list[Upstream]:
        raise UnknownService(f"no service {service!r}")

    h = await make_proxy([])
    h.proxy.pick = pick
    async with http.get(h.infer_url(service="ghost"), headers=REGION) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "unknown_service"


async def test_known_service_without_sites_is_503_no_capacity(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    h = await make_proxy([], services=("llm",))
    async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_capacity"
        assert "X-Cpn-Route-Ms" in resp.headers


async def test_oversized_body_is_a_413(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    up, upstream = await echo(serve, "a")
    h = await make_proxy([up], max_body_bytes=1000)

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"x" * 400  # no Content-Length: the limit holds while reading

    for data in (b"x" * 1001, chunked()):
        async with http.post(h.infer_url(), data=data, headers=REGION) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
        assert (error["code"], error["field"]) == ("too_large", "body")
    async with http.post(h.infer_url(), data=b"x" * 1000, headers=REGION) as resp:
        assert resp.status == 200
    assert len(upstream.hits) == 1


async def test_rate_limit_per_tenant_is_a_429_with_retry_after(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    clock = FakeClock()
    up, _ = await echo(serve, "a")
    limiter = TenantLimiter(default=RateLimit(rate_per_s=0.5, burst=2))
    h = await make_proxy([up], limiter=limiter, clock=clock)

    async def status(tenant: str) -> aiohttp.ClientResponse:
        async with http.get(h.infer_url(), headers={**REGION, "X-Cpn-Tenant": tenant}) as resp:
            await resp.read()
            return resp

    assert [(await status("acme")).status for _ in range(2)] == [200, 200]
    limited = await status("acme")
    assert limited.status == 429
    assert limited.headers["Retry-After"] == "2"
    async with http.get(h.infer_url(), headers={**REGION, "X-Cpn-Tenant": "acme"}) as resp:
        error = (await resp.json())["error"]
    assert (error["code"], error["field"]) == ("rate_limited", "X-Cpn-Tenant")
    assert (await status("other")).status == 200
    clock.advance(2)
    assert (await status("acme")).status == 200


async def test_counts_its_own_requests_in_flight_per_site(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    dead = Upstream("dead", dead_url(), replica=True)  # replicas of several at their sites
    slow, _ = await echo(serve, "slow", delay_s=0.5)
    slow = slow._replace(replica=True)
    h = await make_proxy([dead, slow])

    async def one() -> int:
        async with http.post(h.infer_url(), json={}, headers=REGION) as resp:
            await resp.read()
            return resp.status

    calls = [asyncio.ensure_future(one()) for _ in range(3)]
    await asyncio.sleep(0.25)
    assert h.proxy.in_flight("llm") == {"slow": 3}  # the refused site was counted and released
    assert h.proxy.in_flight("other") == {}
    # and per replica, for the choice among a site's replicas
    assert h.proxy.replica_in_flight("llm", "slow", slow.base_url) == 3
    assert h.proxy.replica_in_flight("llm", "dead", dead.base_url) == 0
    assert await asyncio.gather(*calls) == [200, 200, 200]
    assert h.proxy.in_flight("llm") == {}
    assert h.proxy.replica_in_flight("llm", "slow", slow.base_url) == 0


async def test_a_body_that_arrived_whole_goes_out_as_a_streamed_one_would(
    serve: Serve, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    """The relay sends a body already in with its headers in one write; the client cannot tell
    it from one streamed as it trickles in (same status, headers and bytes)."""
    payload = b'{"text": "' + b"x" * 3000 + b'"}'

    async def whole(request: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, status=201, content_type="application/json",
                            headers={"X-Up": "1"})  # fmt: skip

    async def trickled(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(status=201, headers={"X-Up": "1"})
        out.content_type = "application/json"
        out.content_length = len(payload)
        await out.prepare(request)
        for i in range(0, len(payload) if request.method != "HEAD" else 0, 1000):
            await out.write(payload[i : i + 1000])
            await asyncio.sleep(0.02)  # the proxy has sent the headers before the rest is in
        await out.write_eof()
        return out

    answers = []
    for handler in (whole, trickled):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        h = await make_proxy([Upstream("a", await serve(app))])
        for method in ("POST", "HEAD"):
            async with http.request(method, h.infer_url(), headers=REGION) as resp:
                body = await resp.read()
                drop = {"Date", "X-Cpn-Route-Ms"}
                headers = sorted((k, v) for k, v in resp.headers.items() if k not in drop)
                answers.append((method, resp.status, headers, body))
    assert answers[0][3] == payload and answers[1][3] == b""
    assert answers[:2] == answers[2:]
