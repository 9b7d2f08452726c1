"""The inference proxy: `ANY /v1/infer/{service}/{path}` to the chosen site, streamed through.

Per request, in this order (docs/inference.md is the long form):

1. client region: header `X-Cpn-Client-Region`, else `resolve_region(peer address)` (CIDR
   map); missing or unknown -> 400 (field `X-Cpn-Client-Region`).
2. tenant: header `X-Cpn-Tenant` (default "anonymous"); over its token bucket -> 429 with
   Retry-After (field `X-Cpn-Tenant`).
3. body: read whole (a retry must resend it), at most `max_body_bytes` -> else 413.
4. candidates: `await pick(service, region, session_key)`, an ordered list of upstreams; the
   time it takes is `X-Cpn-Route-Ms`. Empty: 404 `unknown_service` when the service is not
   in `known_services()`, else 503 `no_capacity`. The session key is header `X-Cpn-Session`,
   else cookie `cpn-session`. With `prefix_chars` > 0 the proxy also computes the request's
   prefix key (header `X-Cpn-Prefix-Key`, else the body's prompt or messages:
   routing.gateway.prefix)
   and passes it as `pick(..., prefix_key=key)` when there is one.
5. attempts: candidates in order, skipping ejected ones (OutlierDetector) and ones the active
   health checker calls unhealthy, at most `max_attempts`. None left -> 503 `no_capacity`.
   After a failed attempt the next candidate is tried when `may_retry` says so:

       failure                                  POST/PATCH   idempotent*
       connect refused / connect timeout        retry        retry      (nothing was sent)
       upstream 429 (no room)                   retry        retry      (it did no work)
       401/403 to the site's key (site_keys)    retry        retry      (it did no work)
       upstream 5xx, response timeout, lost     no           retry
       * GET, HEAD, OPTIONS, PUT, DELETE, or any request carrying `Idempotency-Key`

   Once the first response byte went to the client nothing is retried: a stream that breaks
   halfway is cut (the client sees a truncated body, never a silently shortened one).
6. response: status and headers copied (minus hop-by-hop), body written chunk by chunk as it
   arrives (chunked and server-sent events pass unbuffered), plus `X-Cpn-Site`,
   `X-Cpn-Attempts`, `X-Cpn-Route-Ms`. When no attempt got an answer: 502 `upstream_unreachable`
   / `upstream_error` or 504 `upstream_timeout`.

Outcomes go to the OutlierDetector keyed `upstream_key(service, upstream)` ("service@site"):
5xx, timeouts and connection errors are failures; any other status is a success; a 429 is
neither (load, not ill health). Timeouts: `connect_timeout_s` for the TCP connect,
`response_timeout_s` for the response headers and again for each gap between body chunks (a
slow stream is fine, a stalled one is not).

The upstream hop goes through routing.gateway.upstream's UpstreamPool (keep-alive connections per
site and source address, the llhttp parser), not aiohttp's client: that was about a third of
the broker's CPU per proxied request.

One module because a request's life here (pick, attempt, retry, eject, stream, count) is
one state machine that reads top to bottom, and it is compiled with the rest of the hot path
(routing.native): the exchange it drives (the lane's or aiohttp's, `_WebExchange`) and the
header helpers are called per request and only from here.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import functools
import itertools
import json
import logging
import random
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Container,
    Iterator,
    Mapping,
    Sequence,
)
from types import MappingProxyType
from typing import NamedTuple, Protocol, TypeVar

import aiohttp
from aiohttp import web

from routing.errors import ProxyError, UnknownRegion, UnknownService
from routing.gateway.health import OutlierDetector
from routing.gateway.openai import (
    BadRequest,
    Meter,
    OpenAIRequest,
    body_for,
    openai_kind,
    prompt_estimate,
    read_request,
    unknown_model,
)
from routing.gateway.openai import error_body as openai_error_body
from routing.gateway.prefix import PREFIX_HEADER, header_key, prefix_key
from routing.gateway.ratelimit import TenantLimiter
from routing.gateway.tally import Billed, Stream, Tally
from routing.gateway.upstream import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamResponse,
    parse_origin,
)
from sites.kits.clock import Clock, SystemClock

__all__ = [
    "IDEMPOTENT_METHODS",
    "Failure",
    "HealthView",
    "InferenceProxy",
    "Pick",
    "TrafficSink",
    "ProxyError",
    "UnknownRegion",
    "UnknownService",
    "Upstream",
    "Exchange",
    "Accountant",
    "Billed",
    "Ticket",
    "Targets",
    "add_routes",
    "error_body",
    "forward_block",
    "path_tail",
    "response_lines",
    "may_retry",
    "upstream_key",
]

log = logging.getLogger(__name__)

REGION_HEADER = "X-Cpn-Client-Region"
TENANT_HEADER = "X-Cpn-Tenant"
TOKEN_KEY = "cpn.caller_token"
"""Where an authenticating middleware leaves the caller's token id (per-token limits)."""
REQUEST_ID_KEY = "cpn.request_id"
"""Where a middleware leaves the request's id (X-Request-Id), the id its tokens settle by."""
TENANT_KEY = "cpn.caller_tenant"
"""Where an authenticating middleware leaves the caller's tenant on the request (it wins over
the X-Cpn-Tenant header: an inference token names its tenant)."""
SESSION_HEADER = "X-Cpn-Session"
PRIORITY_HEADER = "X-Cpn-Priority"
SERVICE_HEADER = "X-Cpn-Service"
"""On an answer: the service that served it (an alias's or a model's target)."""
SESSION_COOKIE = "cpn-session"
DEFAULT_TENANT = "anonymous"
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# RFC 9110 7.6.1 connection-specific fields, plus Host and Content-Length, which aiohttp sets
# for the hop it makes.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length"}
_NONE_ACTIVE: dict[str, int] = {}
_NO_EJECTIONS: Mapping[str, float] = MappingProxyType({})
_K = TypeVar("_K")


def _count(counts: dict[_K, int], key: _K, step: int) -> None:
    """Add `step` to a count of requests in flight; a count back at zero is removed."""
    left = counts.get(key, 0) + step
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


# the same sets as bytes, for the raw headers both hops carry
_HOP_BY_HOP_B = frozenset(name.encode() for name in _HOP_BY_HOP)
# X-Forwarded-*: replaced by this hop's own (see _forward_headers)
_NOT_FORWARDED_B = frozenset(name.encode() for name in _NOT_FORWARDED) | {
    b"x-forwarded-for",
    b"x-forwarded-proto",
    b"x-forwarded-host",
}
# a gateway's clients' credentials: for the gateway, not the site (drop_credentials)
_CREDENTIALS = frozenset({b"authorization"})
# what an answer the proxy frames itself does not copy from the upstream's (response_lines)
_NOT_RELAYED_B = _HOP_BY_HOP_B | {b"content-length"}


class Upstream(NamedTuple):
    site: str
    base_url: str
    # the local address to connect from: on a one-machine federation the WAN emulation tells
    # the client region by it (docs/wan-emulation.md); None in a real deployment
    source_ip: str | None = None
    # one replica of several at its site: its outcomes and health are its own, not the site's
    replica: bool = False


class Pick(Protocol):
    """(service, client region, session key) -> the upstreams, best first. `prefix_key` is
    passed only by a proxy with prefix_chars > 0, and only when the request has one."""

    def __call__(
        self,
        service: str,
        region: str | None,
        session_key: str | None,
        /,
        *,
        prefix_key: str | None = None,
    ) -> Awaitable[Sequence[Upstream]]: ...


Observe = Callable[[str, str, float], None]
"""(client region, site that answered, seconds from arrival to the answer's end): called once
per request that reached a site (the broker counts it: cpn_proxy_request_duration_seconds)."""


class TrafficSink(Protocol):
    """Where the proxy counts demand per (service, client region), for the autoscaler
    (broker.state.traffic.TrafficBook): both calls O(1), on the request's path."""

    def request(self, service: str, region: str) -> None:
        """A request for a known service from a known client region (answered or not)."""

    def first_byte(self, service: str, region: str, seconds: float) -> None:
        """The answer's first byte went to the client `seconds` after the request arrived."""


Targets = Sequence[Sequence[tuple[str, float]]]
"""What a model name resolves to: ranks, best first, each of (service, weight); the next rank
serves when every site of every service in the ranks before it is saturated or down."""

ResolveModel = Callable[[str, str], "Targets | None"]
"""(model as the body names it, tenant) -> its targets; None: no such model for that tenant."""

ServedName = Callable[[str, str], "str | None"]
"""(service chosen, model as the body names it) -> the name its model server serves it by, when
the body's differs (an alias's, a service's); None: send the body's."""


class Ticket(Protocol):
    """One metered answer (broker.state.token_ledger's write-ahead ticket)."""

    @property
    def words(self) -> memoryview | None:
        """The ledger's file as int64 words, where the answer's Meter stores its delivered
        chunks itself (Meter.track); None: call `progress` instead."""

    @property
    def word(self) -> int:
        """The index in `words` of this answer's delivered count."""

    def progress(self, completion_tokens: int) -> None:
        """Tokens of the answer that reached the client so far (per streamed chunk)."""

    def settle(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, counted: bool
    ) -> None:
        """The answer ended: bill it (`counted`: the server reported no usage)."""


class Accountant(Protocol):
    """Token accounting and limits for the OpenAI paths (broker.api.inference's)."""

    def admit(self, tenant: str, token_id: str | None) -> tuple[int, str, str, str, Extra] | None:
        """None to go on, else (status, code, message, field, headers) to refuse with."""

    def open(self, billed: Billed, prompt_tokens: int) -> Ticket:
        """Before the answer's first byte goes to the client (write-ahead)."""

    def settle(self, billed: Billed, usage: tuple[int, int, int], counted: bool) -> None:
        """A whole answer that reached the client: (prompt, completion, cached) tokens."""


class HealthView(Protocol):
    """What the proxy asks of the active health checker
    (routing.gateway.health.ActiveHealthChecker)."""

    def is_healthy(self, key: str) -> bool: ...


def upstream_key(service: str, upstream: Upstream) -> str:
    """The key of one (service, site) endpoint for the outlier detector and health checks:
    "service@site", or "service@site#url" for one replica of several at the site (ejecting it
    leaves the site and its other replicas routable)."""
    if upstream.replica:
        return f"{service}@{upstream.site}#{upstream.base_url}"
    return f"{service}@{upstream.site}"


class Failure(enum.StrEnum):
    not_sent = "not_sent"  # connect refused or timed out: the request never left
    busy = "busy"  # upstream 429: it turned the request away without doing the work
    status_5xx = "5xx"
    timeout = "timeout"  # no response headers within response_timeout_s
    broken = "broken"  # the connection failed after the request was (maybe) sent
    key_refused = "key_refused"  # 401/403 to the site's own key (site_keys): nothing was done


def may_retry(failure: Failure, *, idempotent: bool) -> bool:
    """Whether a failed attempt may go to the next candidate (see the module docstring)."""
    return failure in (Failure.not_sent, Failure.busy, Failure.key_refused) or idempotent


Extra = Sequence[tuple[str, str]]
"""Headers the proxy adds to an answer (X-Cpn-*, Retry-After): (name, value), ASCII."""
RawHeaders = Sequence[tuple[bytes, bytes]]


class Exchange(Protocol):
    """One request and its answer, as the proxy's core (`InferenceProxy.serve`) sees them.

    Two implement it: `_WebExchange` over aiohttp's server (`InferenceProxy.handle`, the
    route add_routes registers) and routing.gateway.lane's, which parses the request itself. The
    request side is plain attributes, read once; the answer is one `refuse`, or one `answer`,
    or `start`, any `send`s, then `finish` (or `cut`)."""

    method: str
    path: str  # as received, for logs
    service: str  # the {service} segment of /v1/infer/{service}/...
    tail: bytes  # the raw (percent-encoded) path after /v1/infer/{service}/, with the query
    region_hint: str  # header X-Cpn-Client-Region, stripped; "" when absent
    remote: str | None  # the peer's address
    tenant: str  # the authenticated tenant, else header X-Cpn-Tenant, else "anonymous"
    session_key: str | None  # header X-Cpn-Session, else cookie cpn-session
    prefix_header: str | None  # header X-Cpn-Prefix-Key as sent
    idempotent: bool  # an idempotent method, or an Idempotency-Key header
    openai: bool  # an OpenAI path at the root (service ""): errors in OpenAI's shape
    token_id: str | None  # the caller's API token, when the gateway authenticates
    request_id: str  # X-Request-Id, as the answer carries it ("" when none)
    priority_header: str | None  # header X-Cpn-Priority as sent

    def forward_headers(self, drop: frozenset[bytes] = frozenset()) -> bytes:
        """The request's headers for the upstream hop (see `forward_block`), less `drop`."""

    async def read_body(self, limit: int) -> bytes | None:
        """The whole body; None when it is over `limit` bytes."""

    def refuse(
        self, status: int, code: str, message: str, field: str | None, headers: Extra = ()
    ) -> None:
        """Answer with the JSON error `{"error": {"code", "message", "field"}}`."""

    async def answer(
        self, status: int, reason: str, headers: RawHeaders, extra: Extra, body: bytes
    ) -> bool:
        """Answer whole: the upstream's headers (hop-by-hop ones dropped), `extra`, `body`.
        False when the client left."""

    async def start(
        self, status: int, reason: str, headers: RawHeaders, extra: Extra, length: int | None
    ) -> bool:
        """Start a streamed answer (`length`: the upstream's Content-Length, if it sent one).
        False when the client left."""

    async def send(self, chunk: bytes) -> bool:
        """One piece of a streamed body. False when the client left."""

    async def finish(self) -> None:
        """End a streamed answer."""

    def cut(self) -> None:
        """Drop the client's connection: a stream broke halfway (no silently short body)."""


class _Refusal(Exception):
    """Raised inside InferenceProxy.serve to answer with a JSON error before any answer."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None, headers: Extra = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers


def error_body(code: str, message: str, field: str | None) -> bytes:
    """The JSON body of every error the proxy answers itself."""
    return json.dumps({"error": {"code": code, "message": message, "field": field}}).encode()


class _Ejections(Mapping[str, float]):
    """InferenceProxy.ejected_sites: site -> end of its ejection, looked up per site."""

    __slots__ = ("_health", "_now", "_prefix")

    def __init__(self, health: OutlierDetector, service: str, now: float) -> None:
        self._health = health
        self._prefix = upstream_key(service, Upstream("", ""))
        self._now = now

    def get(self, site: str, default: float | None = None) -> float | None:  # type: ignore[override]
        until = self._health.ejected_until(self._prefix + site, self._now)
        return default if until is None else until

    def __contains__(self, site: object) -> bool:
        return isinstance(site, str) and self.get(site) is not None

    def __getitem__(self, site: str) -> float:
        until = self.get(site)
        if until is None:
            raise KeyError(site)
        return until

    def __iter__(self) -> Iterator[str]:
        prefix = self._prefix
        keys = self._health.ejections(self._now)
        # a replica's ejection ("service@site#url") is not its site's
        return iter(
            [key[len(prefix) :] for key in keys if key.startswith(prefix) and "#" not in key]
        )

    def __len__(self) -> int:
        return sum(1 for _ in self)


_QUEUE_POLL_S = 0.05
"""How often the first request in line looks for room when no request of ours ended: room
also frees at sites through other gateways and their own clients."""


class _Waiter:
    __slots__ = ("key", "woken")

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.woken = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.woken.wait(), timeout_s)
        except TimeoutError:
            pass
        self.woken.clear()


class _Line:
    """Requests waiting for room for one model: higher priority first, then arrival."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[_Waiter] = []

    def __len__(self) -> int:
        return len(self.waiters)

    def join(self, priority: int, arrival: int) -> _Waiter:
        waiter = _Waiter((-priority, arrival))
        keys = [w.key for w in self.waiters]
        self.waiters.insert(bisect.bisect(keys, waiter.key), waiter)
        return waiter

    def first(self) -> _Waiter | None:
        return self.waiters[0] if self.waiters else None

    def leave(self, waiter: _Waiter) -> None:
        was_first = self.first() is waiter
        try:
            self.waiters.remove(waiter)
        except ValueError:
            return
        if was_first:
            self.wake_first()  # the next in line looks for room at once

    def wake_first(self) -> None:
        if self.waiters:
            self.waiters[0].woken.set()


class _Attempt(NamedTuple):
    upstream: Upstream
    response: UpstreamResponse | None
    failure: Failure | None
    detail: str


class InferenceProxy:
    """Routes `/v1/infer/{service}/{path}` to the best site; see the module docstring."""

    def __init__(
        self,
        *,
        pick: Pick,
        health: OutlierDetector,
        limiter: TenantLimiter | None,
        connect_timeout_s: float,
        response_timeout_s: float,
        max_attempts: int,
        max_body_bytes: int,
        session: aiohttp.ClientSession | None = None,
        pool: UpstreamPool | None = None,
        known_services: Callable[[], Collection[str]] | None = None,
        resolve_region: Callable[[str], str | None] | None = None,
        known_regions: Callable[[], Container[str]] | None = None,
        require_region: bool = True,
        active: HealthView | None = None,
        clock: Clock | None = None,
        observe: Observe | None = None,
        prefix_chars: int = 0,
        traffic: TrafficSink | None = None,
        drop_credentials: bool = False,
        site_keys: Mapping[tuple[str, str], str] | None = None,
        resolve_model: ResolveModel | None = None,
        served_name: ServedName | None = None,
        default_region: str | None = None,
        accountant: Accountant | None = None,
        default_priority: Callable[[str], int] | None = None,
        pass_priority: Container[str] = frozenset(),
        queue_timeout_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        """`pool` carries the upstream requests (a new one when None; `close()` closes it).
        `session` is not used for them: it is accepted for callers that still pass one.
        `prefix_chars`: bytes of the prompt that make the prefix key (0: no prefix keys).
        `traffic`: counts requests and their time to first byte per service and client region.
        `drop_credentials`: the client's Authorization header is not sent on to the site (the
        broker's gateway, whose clients authenticate with their cpn token: the site must not
        see it).
        `site_keys`: (site, service, or "*" for every service there) -> the key that site's
        model servers require, sent as `Authorization: Bearer <key>` in place of the client's
        header (broker.placement.settings.SiteKey).
        `resolve_model`: the OpenAI paths' model -> targets (None: those paths answer 404).
        `served_name`: the model name to send the chosen service's server (OpenAI paths).
        `default_region`: the client region of an OpenAI path's request that names none and
        comes from no known address (the broker's own region; None: 400 as /v1/infer).
        `accountant`: token limits before, and token accounting after, an OpenAI path's
        answer (also `/v1/infer/{service}/v1/chat/completions` and the like).
        `default_priority`: tenant -> its requests' priority when they name none.
        `pass_priority`: services whose model server takes cpn's priority (as vLLM's `priority`,
        negated: vLLM serves lower values first); elsewhere a body's `priority` is removed.
        `queue_timeout_s`: how long a request with priority >= 0 waits in the gateway while
        every site of its targets is saturated (0: it goes to the overflow choice at once)."""
        if connect_timeout_s <= 0 or response_timeout_s <= 0:
            raise ValueError("connect_timeout_s and response_timeout_s must be > 0")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        self.pick = pick
        self.health = health
        self.limiter = limiter
        self.max_attempts = max_attempts
        self.max_body_bytes = max_body_bytes
        self.session = session
        self.pool = pool or UpstreamPool()
        self.connect_timeout_s = connect_timeout_s
        self.response_timeout_s = response_timeout_s
        # service -> site -> requests in flight through us (read per request by the router)
        self._active: dict[str, dict[str, int]] = {}
        # (service, site, replica URL) -> requests in flight through us, for replicas of several at
        # a site (the router's choice among them weighs it)
        self._active_replicas: dict[tuple[str, str, str], int] = {}
        self.known_services = known_services
        self.resolve_region = resolve_region
        self.known_regions = known_regions
        self.require_region = require_region
        self.active = active
        self.clock: Clock = clock or SystemClock()
        self.observe = observe
        self.prefix_chars = prefix_chars
        self.traffic = traffic
        self.not_forwarded = _CREDENTIALS if drop_credentials else frozenset()
        self._not_forwarded_keyed = self.not_forwarded | _CREDENTIALS  # to a site with its key
        self.resolve_model = resolve_model
        self.served_name = served_name
        self.default_region = default_region
        self.accountant = accountant
        # the broker's accountant, called natively (a Protocol's calls go through Python's)
        self.tally: Tally | None = accountant if isinstance(accountant, Tally) else None
        self.default_priority = default_priority
        self.pass_priority = pass_priority
        self.queue_timeout_s = queue_timeout_s
        self._rng = rng or random.Random()
        # requested model -> its requests waiting for room (_choose)
        self._lines: dict[str, _Line] = {}
        self._arrivals = itertools.count()
        self._key_lines = {
            where: b"Authorization: Bearer %s\r\n" % key.encode("ascii")
            for where, key in (site_keys or {}).items()
        }

    async def close(self) -> None:
        """Close the upstream connections."""
        await self.pool.close()

    def ejected_sites(self, service: str, now: float) -> Mapping[str, float]:
        """Site -> end of its ejection for `service`, for routing.decision.candidates' candidates.

        A view, valid at `now`: a lookup asks the detector about that one site, so a request
        pays for its service's candidates, not for every upstream the detector knows; while
        nothing is ejected, an empty mapping."""
        if not self.health.ejecting(now):
            return _NO_EJECTIONS
        return _Ejections(self.health, service, now)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """aiohttp's handler for the route add_routes registers: `serve` over _WebExchange."""
        exchange = _WebExchange(request)
        await self.serve(exchange)
        if exchange.response is None:
            raise RuntimeError("unreachable: serve always answers")
        return exchange.response

    async def serve(self, exchange: Exchange) -> None:
        """Proxy one request, as the module docstring says; its answer goes out by `exchange`."""
        try:
            await self._serve(exchange)
        except _Refusal as no:
            exchange.refuse(no.status, no.code, no.message, no.field, no.headers)

    async def _serve(self, ex: Exchange) -> None:
        arrived = self.clock.monotonic()
        service = ex.service
        if service and has_dot_segment(ex.tail):
            raise _Refusal(
                400,
                "invalid_path",
                "the path has a '.' or '..' segment, which the site would resolve outside "
                f"/v1/infer/{ex.service}/: send it resolved",
                "path",
            )
        region = self._client_region(ex)
        tenant = ex.tenant
        if self.limiter is not None:
            decision = self.limiter.acquire(tenant, self.clock.monotonic())
            if not decision.allowed:
                raise _Refusal(
                    429,
                    "rate_limited",
                    f"tenant {tenant!r} is over its rate limit; retry in "
                    f"{decision.retry_after_s:.2f} s",
                    TENANT_HEADER,
                    (("Retry-After", decision.retry_after_header),),
                )
        kind = openai_kind(ex.tail)
        accountant = self.accountant if kind is not None else None
        if accountant is not None:
            tally = self.tally
            if tally is not None:
                refused = tally.admit(tenant, ex.token_id)
            else:
                refused = accountant.admit(tenant, ex.token_id)
            if refused is not None:
                raise _Refusal(*refused)
        body = await ex.read_body(self.max_body_bytes)
        if body is None:
            raise _Refusal(
                413, "too_large", f"request body over {self.max_body_bytes} bytes", "body"
            )
        request: OpenAIRequest | None = None
        if kind is not None:
            try:
                request = read_request(body, kind, ask_usage=accountant is not None)
            except BadRequest as bad:
                if not service:
                    raise _Refusal(400, "invalid_request", bad.message, bad.param) from None
                # the passthrough sends what it is given; its answer is metered as it comes
        priority = self._priority(ex, tenant)
        targets: Targets
        if service:
            targets = (((service, 1.0),),)
        else:
            if request is None:
                raise RuntimeError("unreachable: the OpenAI paths read their body")
            resolve = self.resolve_model
            found = resolve(request.model, tenant) if resolve is not None else None
            if not found:
                raise _Refusal(
                    404, "model_not_found",
                    unknown_model(request.model),
                    "model",
                )  # fmt: skip
            targets = found
        session_key = ex.session_key or None
        prefix = None
        if self.prefix_chars > 0:
            given = ex.prefix_header
            prefix = header_key(given) if given is not None else prefix_key(body, self.prefix_chars)

        started = self.clock.monotonic()
        service, candidates = await self._choose(
            targets, region, session_key, prefix, priority,
            request.model if request is not None else service,
        )  # fmt: skip
        route_ms = f"{(self.clock.monotonic() - started) * 1000:.3f}"

        if not candidates:
            if self.known_services is not None and service not in self.known_services():
                raise _Refusal(
                    404, "unknown_service", f"no service named {service!r}", "service",
                    (("X-Cpn-Route-Ms", route_ms),),
                )  # fmt: skip
            if self.traffic is not None and region is not None:
                self.traffic.request(service, region)  # demand nobody could serve counts too
            raise _Refusal(
                503, "no_capacity",
                f"no site can take a {service!r} request from region {region!r} now", None,
                (("X-Cpn-Route-Ms", route_ms), ("Retry-After", "1")),
            )  # fmt: skip
        if self.traffic is not None and region is not None:
            self.traffic.request(service, region)
        metered: _Metered | None = None
        if request is not None:
            server_priority = -priority if service in self.pass_priority else None
            served = None
            if ex.openai and self.served_name is not None:
                served = self.served_name(service, request.model)
            body = body_for(request, body, server_priority=server_priority, model=served)
        if accountant is not None:
            metered = _Metered(
                accountant, request, ex, tenant, service, region or "none",
                request.model if request is not None else service, self.tally,
            )  # fmt: skip
        site = await self._forward(
            ex, service, candidates, body, route_ms, region, arrived, metered
        )
        if self.observe is not None and site is not None:
            self.observe(region or "none", site, self.clock.monotonic() - arrived)

    def _priority(self, ex: Exchange, tenant: str) -> int:
        given = ex.priority_header
        if given is not None:
            try:
                return int(given.strip())
            except ValueError:
                raise _Refusal(
                    400, "invalid_priority",
                    f"{PRIORITY_HEADER} must be an integer (negative: sheddable), got {given!r}",
                    PRIORITY_HEADER,
                ) from None  # fmt: skip
        if self.default_priority is not None:
            return self.default_priority(tenant)
        return 0

    async def _pick(
        self,
        service: str,
        region: str | None,
        session_key: str | None,
        prefix: str | None,
        several: bool,
    ) -> Sequence[Upstream]:
        try:
            if prefix is None:
                return await self.pick(service, region, session_key)
            return await self.pick(service, region, session_key, prefix_key=prefix)
        except UnknownRegion as exc:
            raise _Refusal(400, "unknown_region", str(exc), REGION_HEADER) from None
        except UnknownService as missing:  # a name of its own: mypyc types `exc` once
            if several:
                return ()  # one target of several has no site now: the others may serve
            raise _Refusal(404, "unknown_service", str(missing), "service") from None

    async def _choose(
        self,
        targets: Targets,
        region: str | None,
        session_key: str | None,
        prefix: str | None,
        priority: int,
        requested: str,
    ) -> tuple[str, Sequence[Upstream]]:
        """The service and upstreams that serve: the first target, in rank order (weighted
        within a rank), with a site that is neither saturated nor down. When all are, a
        sheddable request (priority < 0) is refused; others wait in line for room (higher
        priority first, then arrival) up to queue_timeout_s, then take the first saturated
        target's overflow choice (the site's own queue)."""
        several = sum(len(rank) for rank in targets) > 1
        line: _Line | None = None
        waiter: _Waiter | None = None
        waited_since = 0.0
        try:
            while True:
                if waiter is None or line is None or line.first() is waiter:
                    first: tuple[str, Sequence[Upstream]] | None = None
                    for rank in targets:
                        for name in self._weighted(rank):
                            candidates = await self._pick(
                                name, region, session_key, prefix, several
                            )
                            if candidates and not getattr(candidates, "overflow", False):
                                return name, candidates
                            if first is None or (candidates and not first[1]):
                                first = (name, candidates)
                    if first is None:
                        raise RuntimeError("unreachable: a model has at least one target")
                    if not first[1]:
                        return first  # down everywhere: nothing to wait for
                    if priority < 0:
                        raise _Refusal(
                            503, "shed",
                            f"every site for {requested!r} is saturated; a request of priority "
                            f"{priority} (sheddable) is refused first",
                            PRIORITY_HEADER, (("Retry-After", "1"),),
                        )  # fmt: skip
                    if self.queue_timeout_s <= 0:
                        return first
                    overflow = first
                now = self.clock.monotonic()
                if waiter is None:
                    line = self._lines.get(requested)
                    if line is None:
                        line = self._lines[requested] = _Line()
                    waiter = line.join(priority, next(self._arrivals))
                    waited_since = now
                left = self.queue_timeout_s - (now - waited_since)
                if left <= 0:
                    return overflow  # waited long enough: the site's own queue takes it
                await waiter.wait(min(left, _QUEUE_POLL_S))
        finally:
            if waiter is not None and line is not None:
                line.leave(waiter)
                if not line:
                    self._lines.pop(requested, None)

    def _weighted(self, rank: Sequence[tuple[str, float]]) -> list[str]:
        """A rank's services in a weighted random order, without replacement (Efraimidis and
        Spirakis: each keyed by u ** (1 / weight), largest first)."""
        if len(rank) == 1:
            return [rank[0][0]]
        rng = self._rng
        keyed = [(rng.random() ** (1.0 / weight), name) for name, weight in rank if weight > 0]
        keyed.sort(reverse=True)
        return [name for _, name in keyed]

    def _room(self) -> None:
        """A request ended: the first in each line looks for room."""
        for line in self._lines.values():
            line.wake_first()

    def _client_region(self, ex: Exchange) -> str | None:
        region = ex.region_hint
        if not region and self.resolve_region is not None and ex.remote:
            region = self.resolve_region(ex.remote) or ""
        if not region and ex.openai and self.default_region:
            region = self.default_region
        if not region:
            if not self.require_region:
                return None
            raise _Refusal(
                400,
                "missing_region",
                f"say where the client is: header {REGION_HEADER}, or connect from an address "
                "in a client region's CIDRs",
                REGION_HEADER,
            )
        if self.known_regions is not None and region not in self.known_regions():
            raise _Refusal(400, "unknown_region", f"no client region {region!r}", REGION_HEADER)
        return region

    async def _forward(
        self,
        ex: Exchange,
        service: str,
        candidates: Sequence[Upstream],
        body: bytes,
        route_ms: str,
        region: str | None = None,
        arrived: float = 0.0,
        metered: _Metered | None = None,
    ) -> str | None:
        """Try the candidates and relay the answer; the site that answered (None if none was
        usable). `metered`: the answer's tokens are billed (an OpenAI path's)."""
        now = self.clock.time()
        usable: list[Upstream] = []
        for candidate in candidates:  # the first max_attempts usable ones, checking no more
            if self._usable(service, candidate, now):
                usable.append(candidate)
                if len(usable) == self.max_attempts:
                    break
        if not usable:
            raise _Refusal(
                503, "no_capacity",
                f"every site for {service!r} ({', '.join(u.site for u in candidates)}) is "
                "ejected or failing health checks", None,
                (("X-Cpn-Route-Ms", route_ms), ("X-Cpn-Attempts", "0"), ("Retry-After", "1")),
            )  # fmt: skip
        idempotent = ex.idempotent
        headers = ex.forward_headers(self.not_forwarded)
        unauthorized: bytes | None = None  # the headers without the client's Authorization
        tail = ex.tail
        method = ex.method.encode("ascii")
        attempt: _Attempt | None = None
        attempts = 0
        for upstream in usable:
            if attempt is not None:
                if attempt.failure is None or not may_retry(attempt.failure, idempotent=idempotent):
                    break
                if not self._usable(service, upstream, self.clock.time()):
                    continue  # ejected by a concurrent request meanwhile
                log.info(
                    "%s %s: %s on %s (%s); trying %s",
                    ex.method, ex.path, attempt.failure, attempt.upstream.site,
                    attempt.detail, upstream.site,
                )  # fmt: skip
                if attempt.response is not None:
                    attempt.response.release()
                    self._finished(service, attempt.upstream)
            sent, with_key = headers, False
            if self._key_lines:
                line = self._key_line(service, upstream.site)
                if line is not None:  # the site's own key, in place of the client's header
                    if unauthorized is None:
                        unauthorized = ex.forward_headers(self._not_forwarded_keyed)
                    sent, with_key = unauthorized + line, True
            attempt = await self._attempt(
                method, service, upstream, tail, sent, body, keyed=with_key
            )
            attempts += 1
        if attempt is None:
            raise RuntimeError("unreachable: the first usable candidate is always tried")
        site = attempt.upstream.site
        extra = (
            ("X-Cpn-Site", site),
            ("X-Cpn-Attempts", str(attempts)),
            ("X-Cpn-Route-Ms", route_ms),
            (SERVICE_HEADER, service),
        )
        if attempt.failure is Failure.key_refused and attempt.response is not None:
            # the site's refusal of the broker's key is no answer to relay to the client,
            # whose own credentials were fine
            attempt.response.release()
            self._finished(service, attempt.upstream)
            attempt = attempt._replace(response=None)
        if attempt.response is None:
            status, code, message = _no_answer(attempt)
            ex.refuse(status, code, message, None, extra)
            return site
        try:
            await self._relay(
                ex, service, attempt.upstream, attempt.response, extra, region, arrived, metered
            )
        finally:
            self._finished(service, attempt.upstream)
        return site

    def _key_line(self, service: str, site: str) -> bytes | None:
        lines = self._key_lines
        return lines.get((site, service)) or lines.get((site, "*"))

    def in_flight(self, service: str) -> dict[str, int]:
        """site -> requests of `service` this proxy has in flight there now (its own view:
        exact and immediate, where the sites' published load is up to an interval old)."""
        return dict(self._active.get(service, _NONE_ACTIVE))

    def replica_in_flight(self, service: str, site: str, url: str) -> int:
        """Requests of `service` this proxy has in flight at the replica `url` (one of several
        at `site`) now."""
        return self._active_replicas.get((service, site, url), 0)

    def _started(self, service: str, upstream: Upstream) -> None:
        _count(self._active.setdefault(service, {}), upstream.site, 1)
        if upstream.replica:
            _count(self._active_replicas, (service, upstream.site, upstream.base_url), 1)

    def _finished(self, service: str, upstream: Upstream) -> None:
        if upstream.replica:
            _count(self._active_replicas, (service, upstream.site, upstream.base_url), -1)
        if self._lines:
            self._room()
        active = self._active.get(service)
        if active is None:
            return
        _count(active, upstream.site, -1)
        if not active:
            del self._active[service]

    def replica_usable(self, service: str, site: str, url: str, now: float) -> bool:
        """May a request go to this replica of several at `site` (not ejected, not failing
        its health checks)? For the router's choice among a site's replicas."""
        return self._usable(service, Upstream(site, url, replica=True), now)

    def _usable(self, service: str, upstream: Upstream, now: float) -> bool:
        key = upstream_key(service, upstream)
        if self.health.is_ejected(key, now):
            return False
        return self.active is None or self.active.is_healthy(key)

    async def _attempt(
        self,
        method: bytes,
        service: str,
        upstream: Upstream,
        tail: bytes,
        headers: bytes,
        body: bytes,
        *,
        keyed: bool = False,
    ) -> _Attempt:
        """One try at `upstream`; `keyed`: `headers` carry the site's own key (site_keys)."""
        key = upstream_key(service, upstream)
        self._started(service, upstream)
        try:
            origin = parse_origin(upstream.base_url)
            response = await self.pool.request(
                origin,
                method,
                origin.prefix + b"/" + tail,
                headers,
                body,
                source_ip=upstream.source_ip,
                connect_timeout_s=self.connect_timeout_s,
                response_timeout_s=self.response_timeout_s,
            )
        except UpstreamConnectError as exc:
            failure, detail = Failure.not_sent, f"{type(exc).__name__}: {exc}"
        except TimeoutError:
            failure, detail = Failure.timeout, "no response headers in time"
        except (UpstreamBroken, OSError, ValueError) as broken:  # mypyc types `exc` once
            failure, detail = Failure.broken, f"{type(broken).__name__}: {broken}"
        else:
            status = response.status
            if status >= 500:
                self.health.report(key, False, self.clock.time())
                return _Attempt(upstream, response, Failure.status_5xx, f"HTTP {status}")
            if status == 429:
                return _Attempt(upstream, response, Failure.busy, "HTTP 429")
            if keyed and status in (401, 403):  # a wrong or rotated key: it serves us nothing
                self.health.report(key, False, self.clock.time())
                return _Attempt(upstream, response, Failure.key_refused, f"HTTP {status}")
            self.health.report(key, True, self.clock.time())
            return _Attempt(upstream, response, None, "")
        connect = failure is Failure.not_sent
        self.health.report(key, False, self.clock.time(), connect_failure=connect)
        self._finished(service, upstream)
        return _Attempt(upstream, None, failure, detail)

    async def _relay(
        self,
        ex: Exchange,
        service: str,
        upstream: Upstream,
        response: UpstreamResponse,
        extra: Extra,
        region: str | None = None,
        arrived: float = 0.0,
        metered: _Metered | None = None,
    ) -> None:
        """Stream `response` to the client chunk by chunk; the client's first byte ends retries.

        A body that already arrived whole with the headers (a Content-Length answer of one
        segment, the common short completion) goes out with its headers in one write: the same
        bytes to the client, where streaming would send headers and body as two. A metered
        answer (2xx) is billed: its usage read as it passes (routing.gateway.openai.Meter)."""
        try:
            status, reason = response.status, response.reason
            whole = (
                None
                if ex.method == "HEAD" or status < 200 or status in (204, 304)
                else response.whole_body()
            )
            traffic = self.traffic if region is not None else None
            meter: Meter | None = None
            ticket: Ticket | None = None
            if metered is not None and 200 <= status < 300:
                meter = Meter(strip=metered.strip)
            if whole is not None and (metered is None or meter is None or not metered.stream):
                sent = await ex.answer(status, reason, response.headers, extra, whole)
                if sent and traffic is not None and region is not None:
                    traffic.first_byte(service, region, self.clock.monotonic() - arrived)
                if meter is not None and metered is not None:
                    meter.whole(whole)  # billed whether or not the client stayed for it
                    metered.settle_whole(upstream.site, meter)
                return
            progress = False  # per chunk a call to ticket.progress (a Meter tracks no slot)
            if meter is not None and metered is not None:
                ticket = metered.open(upstream.site)  # written ahead of the first byte
                words = ticket.words
                if words is not None:
                    meter.track(words, ticket.word)
                else:
                    progress = True
            length = response.content_length
            if meter is not None and meter.strip:
                length = None  # what is taken out changes the length
            try:
                if not await ex.start(status, reason, response.headers, extra, length):
                    return  # the client left before the answer
                if whole is not None:
                    chunks: list[bytes] = [whole]
                else:
                    chunks = []
                while True:
                    if chunks:
                        chunk = chunks.pop()
                    else:
                        try:
                            chunk = await response.read_any()
                        except (UpstreamBroken, TimeoutError, OSError) as exc:
                            # Bytes already went out: no retry; cut the client's stream so it
                            # sees the break instead of a body that looks complete.
                            key = upstream_key(service, upstream)
                            self.health.report(key, False, self.clock.time())
                            log.warning(
                                "%s %s: upstream %s broke mid-stream (%s: %s); cutting the "
                                "client off",
                                ex.method, ex.path, upstream.site, type(exc).__name__, exc,
                            )  # fmt: skip
                            ex.cut()
                            return
                        if not chunk:
                            if meter is not None:
                                rest = meter.end()
                                if progress and ticket is not None:
                                    ticket.progress(meter.chunks)
                                if rest and not await ex.send(rest):
                                    return
                            break
                    if meter is not None:
                        chunk = meter.feed(chunk)
                        if not chunk:
                            continue
                        if progress and ticket is not None:
                            # written ahead of the bytes: a kill between the two bills a chunk
                            # the client may miss, never one it got unbilled (a tracking
                            # Meter stored it in feed)
                            ticket.progress(meter.chunks)
                    if not await ex.send(chunk):
                        return  # the client left; the finally drops the upstream connection
                    if traffic is not None and region is not None:
                        # the first token of a stream: what the SLO is about
                        traffic.first_byte(service, region, self.clock.monotonic() - arrived)
                        traffic = None
                await ex.finish()
            finally:
                if ticket is not None and meter is not None and metered is not None:
                    metered.settle(ticket, meter, True)
        finally:
            if response.at_eof():
                response.release()
            else:
                response.close()


class _Metered:
    """An OpenAI path's request, to bill its answer: who asked, for what, from where."""

    __slots__ = (
        "accountant", "request", "ex", "tenant", "service", "region", "requested", "tally",
    )  # fmt: skip

    def __init__(
        self,
        accountant: Accountant,
        request: OpenAIRequest | None,
        ex: Exchange,
        tenant: str,
        service: str,
        region: str,
        requested: str,
        tally: Tally | None = None,
    ) -> None:
        self.accountant = accountant
        self.tally = tally  # the accountant, when it is the compiled one: called natively
        self.request = request
        self.ex = ex
        self.tenant = tenant
        self.service = service
        self.region = region
        self.requested = requested

    @property
    def stream(self) -> bool:
        return self.request is not None and self.request.stream

    @property
    def strip(self) -> bool:
        return self.request is not None and self.request.strip_usage

    def billed(self, site: str) -> Billed:
        ex = self.ex
        return Billed(
            ex.request_id, self.tenant, ex.token_id, self.requested, self.service, site,
            self.region,
        )  # fmt: skip

    def open(self, site: str) -> Ticket:
        request = self.request
        prompt = prompt_estimate(request) if request is not None else 0
        tally = self.tally
        if tally is not None:
            return tally.open(self.billed(site), prompt)
        return self.accountant.open(self.billed(site), prompt)

    def settle_whole(self, site: str, meter: Meter) -> None:
        """A whole answer: the server's usage, else the prompt estimated (counted)."""
        usage = meter.usage
        if usage is not None:
            counts, counted = (
                (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
                False,
            )
        else:
            request = self.request
            counts = (prompt_estimate(request) if request is not None else 0, 0, 0)
            counted = True
        tally = self.tally
        if tally is not None:
            tally.settle(self.billed(site), counts, counted)
        else:
            self.accountant.settle(self.billed(site), counts, counted)

    def settle(self, ticket: Ticket, meter: Meter, delivered: bool) -> None:
        """Bill the answer once: the server's usage, else what the gateway counted reached
        the client (nothing, for an answer that never reached it)."""
        usage = meter.usage
        if usage is not None and delivered:
            counts = (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
            counted = False
        else:
            request = self.request
            prompt = prompt_estimate(request) if request is not None and delivered else 0
            counts, counted = (prompt, meter.chunks, 0), True
        if isinstance(ticket, Stream):  # the compiled accountant's: a native call
            ticket.settle(counts[0], counts[1], counts[2], counted=counted)
        else:
            ticket.settle(counts[0], counts[1], counts[2], counted=counted)


class _WebExchange:
    """An Exchange over aiohttp's server: the request as aiohttp parsed it; the answer is
    `response`, which the route's handler returns."""

    __slots__ = (
        "request",
        "response",
        "method",
        "path",
        "service",
        "tail",
        "region_hint",
        "remote",
        "tenant",
        "session_key",
        "prefix_header",
        "idempotent",
        "openai",
        "token_id",
        "request_id",
        "priority_header",
    )

    def __init__(self, request: web.Request) -> None:
        headers = request.headers
        self.request = request
        self.response: web.StreamResponse | None = None
        self.method = request.method
        self.path = request.path
        service = request.match_info.get("service")
        self.openai = service is None  # an OpenAI path at the root: the body names the model
        if service is None:
            self.service = ""
            self.tail = request.raw_path.lstrip("/").encode("utf-8", "surrogateescape")
        else:
            self.service = service
            self.tail = path_tail(request.raw_path).encode("utf-8", "surrogateescape")
        self.token_id: str | None = request.get(TOKEN_KEY)
        self.request_id: str = request.get(REQUEST_ID_KEY) or ""
        self.priority_header = headers.get(PRIORITY_HEADER)
        self.region_hint = headers.get(REGION_HEADER, "").strip()
        self.remote = request.remote
        self.tenant = (
            request.get(TENANT_KEY) or headers.get(TENANT_HEADER, "").strip() or DEFAULT_TENANT
        )
        self.session_key = (
            headers.get(SESSION_HEADER) or request.cookies.get(SESSION_COOKIE) or None
        )
        self.prefix_header = headers.get(PREFIX_HEADER)
        self.idempotent = self.method in IDEMPOTENT_METHODS or "Idempotency-Key" in headers

    def forward_headers(self, drop: frozenset[bytes] = frozenset()) -> bytes:
        request = self.request
        return forward_block(
            request.raw_headers,
            request.remote,
            request.scheme,
            request.host.encode("utf-8", "surrogateescape"),
            drop,
        )

    async def read_body(self, limit: int) -> bytes | None:
        request = self.request
        if request.content_length is not None and request.content_length > limit:
            return None
        content = request.content
        if content.is_eof() and content.exception() is None:
            body = content.read_nowait()  # all of it came with the headers: no read loop
            return None if len(body) > limit else body
        chunks: list[bytes] = []
        size = 0
        async for chunk in content.iter_any():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def refuse(
        self, status: int, code: str, message: str, field: str | None, headers: Extra = ()
    ) -> None:
        if self.openai:
            self.response = web.Response(
                body=openai_error_body(status, code, message, field),
                status=status,
                content_type="application/json",
                headers=dict(headers) or None,
            )
            return
        body = {"error": {"code": code, "message": message, "field": field}}
        self.response = web.json_response(body, status=status, headers=dict(headers) or None)

    async def answer(
        self, status: int, reason: str, headers: RawHeaders, extra: Extra, body: bytes
    ) -> bool:
        out = _response_headers(headers)
        out.extend(extra)
        response = self.response = web.Response(
            body=body, status=status, reason=reason, headers=out
        )
        try:
            await response.prepare(self.request)
            await response.write_eof()
        except ConnectionError:
            return False
        return True

    async def start(
        self,
        status: int,
        reason: str,
        headers: RawHeaders,
        extra: Extra,
        length: int | None,  # noqa: ARG002
    ) -> bool:
        # `length`: the upstream's Content-Length, if any, is among `headers`
        out = _response_headers(headers)
        out.extend(extra)
        response = self.response = web.StreamResponse(status=status, reason=reason, headers=out)
        try:
            await response.prepare(self.request)
        except ConnectionError:
            return False
        return True

    async def send(self, chunk: bytes) -> bool:
        if self.response is None:
            raise RuntimeError("send before start")
        try:
            await self.response.write(chunk)
        except ConnectionError:
            return False
        return True

    async def finish(self) -> None:
        if self.response is None:
            raise RuntimeError("finish before start")
        try:
            await self.response.write_eof()
        except ConnectionError:
            pass  # the client left at the very end

    def cut(self) -> None:
        if self.request.transport is not None:
            self.request.transport.close()


def _no_answer(attempt: _Attempt) -> tuple[int, str, str]:
    """(status, code, message) when no attempt got an answer."""
    site = attempt.upstream.site
    if attempt.failure is Failure.timeout:
        return 504, "upstream_timeout", f"site {site!r} did not answer in time"
    if attempt.failure is Failure.not_sent:
        return 502, "upstream_unreachable", f"cannot connect to site {site!r}: {attempt.detail}"
    if attempt.failure is Failure.key_refused:
        return (
            502,
            "upstream_key_refused",
            f"site {site!r} refused the key the broker sends it ({attempt.detail})",
        )
    return 502, "upstream_error", f"site {site!r} failed the request: {attempt.detail}"


def _connection_tokens(values: Sequence[bytes]) -> frozenset[bytes]:
    """The field names a Connection header lists (RFC 9110 7.6.1), lower case."""
    return frozenset(t.strip().lower() for v in values for t in v.split(b",") if t.strip())


# upstream (name, value) -> the decoded pair: the same few headers come back on every answer
_DECODED: dict[tuple[bytes, bytes], tuple[str, str]] = {}
_DECODED_MAX = 1024


def _response_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The upstream's response headers minus hop-by-hop ones, for the client's answer."""
    out = []
    decoded = _DECODED
    for pair in raw:
        got = decoded.get(pair)
        if got is None:  # never a hop-by-hop field: those are not cached
            name, value = pair
            lower = name.lower()
            if lower in _HOP_BY_HOP_B:
                if lower == b"connection":
                    return _response_headers_listed(raw)
                continue
            if len(decoded) >= _DECODED_MAX:
                decoded.clear()
            got = decoded[pair] = (
                name.decode("utf-8", "surrogateescape"),
                value.decode("utf-8", "surrogateescape"),
            )
        out.append(got)
    return out


def _response_headers_listed(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """_response_headers for an answer with a Connection header: minus the fields it lists."""
    skip = _HOP_BY_HOP_B | _connection_tokens([v for n, v in raw if n.lower() == b"connection"])
    return [
        (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        for name, value in raw
        if name.lower() not in skip
    ]


# header blocks -> their lines, kept (functools.lru_cache): a site sends the same headers on
# every answer (its Date moves once a second), a client the same on every request of a
# connection
_LINES_MAX = 1024


def response_lines(raw: RawHeaders) -> bytes:
    """The upstream's response headers as CRLF-terminated lines for a client answer the proxy
    frames itself (routing.gateway.lane): minus hop-by-hop fields, those a Connection header lists,
    and Content-Length (the framer writes its own)."""
    return _response_lines(tuple(raw))


@functools.lru_cache(maxsize=_LINES_MAX)
def _response_lines(raw: tuple[tuple[bytes, bytes], ...]) -> bytes:
    skip = _NOT_RELAYED_B
    for name, _ in raw:
        if name.lower() == b"connection":
            listed = [v for n, v in raw if n.lower() == b"connection"]
            skip = skip | _connection_tokens(listed)
            break
    return b"".join([n + b": " + v + b"\r\n" for n, v in raw if n.lower() not in skip])


def forward_block(
    raw: RawHeaders,
    remote: str | None,
    scheme: str,
    host: bytes,
    drop: frozenset[bytes] = frozenset(),
) -> bytes:
    """The client's request headers for the upstream hop as CRLF-terminated lines: minus
    hop-by-hop ones, Host and Content-Length (the pool sets both) and the lower-case names in
    `drop`, plus X-Forwarded-* (`host`: the Host the client asked for)."""
    return _forward_block(tuple(raw), remote, scheme, host, drop)


@functools.lru_cache(maxsize=_LINES_MAX)
def _forward_block(
    raw: tuple[tuple[bytes, bytes], ...],
    remote: str | None,
    scheme: str,
    host: bytes,
    drop: frozenset[bytes],
) -> bytes:
    skip = _NOT_FORWARDED_B | drop if drop else _NOT_FORWARDED_B
    prior = None
    for name, value in raw:
        lower = name.lower()
        if lower == b"connection":
            listed = [v for n, v in raw if n.lower() == b"connection"]
            skip = skip | _connection_tokens(listed)
        elif lower == b"x-forwarded-for":
            prior = value if prior is None else prior + b", " + value
    block = b"".join(
        [name + b": " + value + b"\r\n" for name, value in raw if name.lower() not in skip]
    )
    peer = (remote or "unknown").encode()
    forwarded_for = prior + b", " + peer if prior else peer
    return block + b"X-Forwarded-For: %s\r\nX-Forwarded-Proto: %s\r\nX-Forwarded-Host: %s\r\n" % (
        forwarded_for,
        scheme.encode(),
        host,
    )


def has_dot_segment(tail: bytes) -> bool:
    """Whether the path part of `tail` has a '.' or '..' segment, percent-encoded or not: the
    site (RFC 3986, 5.2.4) would resolve it to another path than the one routed, another
    service's or none of the model server's API."""
    path = tail.split(b"?", 1)[0]
    if path.find(b".") < 0 and path.find(b"%2") < 0:  # not `in`: it makes a TypeError
        return False
    for segment in path.split(b"/"):
        if segment.lower().replace(b"%2e", b".") in (b".", b".."):
            return True
    return False


def path_tail(raw_path: str) -> str:
    """The raw (still percent-encoded) path after /v1/infer/{service}/, with the query."""
    parts = raw_path.split("/", 4)  # ['', 'v1', 'infer', service, tail?query]
    return parts[4] if len(parts) == 5 else ""


def add_routes(app: web.Application, proxy: InferenceProxy) -> None:
    """Route `ANY /v1/infer/{service}/{path}` to `proxy`."""
    app.router.add_route("*", "/v1/infer/{service}/{path:.*}", proxy.handle)
