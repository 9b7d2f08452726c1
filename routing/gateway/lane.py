"""The inference lane: the broker's listener reads `/v1/infer/...` requests itself.

aiohttp's server (its parser, a Request object, URL dispatch, the middleware chain, a
Response object) was 15-20 % of the broker's CPU per proxied request (bench/JOURNAL.md,
2026-12-01, inference_routing.py). The lane is the listener's protocol: it reads each request
head on a connection, and

- a request for `/v1/infer/{service}/...` is parsed by httptools (llhttp), admitted by the
  `Guard` (the broker's tokens, request ids and request counters: broker.api.inference) and
  served by `InferenceProxy.serve` over `LaneExchange`, which writes the answer's bytes
  itself (one write for a whole answer);
- at the first request for anything else the connection, with every byte read so far, goes
  to aiohttp's RequestHandler (`fallback`) for good: the API is served exactly as without
  the lane. So is a request the lane leaves alone: a dot segment or a %-escape in its
  service, an Upgrade, or a head llhttp refuses (aiohttp answers it as it always did).

HTTP/1.1 as a server must: keep-alive (HTTP/1.0 too with `Connection: keep-alive`),
`Expect: 100-continue`, Content-Length and chunked bodies, pipelined requests (answered in
order; reading pauses while more than HIGH_WATER bytes wait), answers streamed chunked or
with the upstream's Content-Length, HEAD, 1xx/204/304 without a body. The head is at most
MAX_HEAD bytes (431 otherwise); a body over the proxy's `max_body_bytes` is a 413, after
which the connection closes (its body is not read). A connection idle (or with half a head)
for `keepalive_s` is closed by one sweep every SWEEP_S, not a timer per request.

After a chunked body the lane cannot tell where the next pipelined request starts without
the parser's help: if one follows in the same read, the answer says `Connection: close`
and the client sends it again on a new connection (RFC 9112 9.3.2).

One module because the lane is one protocol object per connection (`_LaneConnection`) and
the exchange it hands the proxy (`LaneExchange`) writes to that connection's transport and
state: split, each half would reach into the other's internals.
"""

from __future__ import annotations

import asyncio
import email.utils
import enum
import functools
import http
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol, cast

import httptools

from routing.gateway.openai import error_body as openai_error_body
from routing.gateway.prefix import PREFIX_HEADER
from routing.gateway.proxy import (
    DEFAULT_TENANT,
    IDEMPOTENT_METHODS,
    PRIORITY_HEADER,
    REGION_HEADER,
    SESSION_COOKIE,
    SESSION_HEADER,
    TENANT_HEADER,
    Extra,
    InferenceProxy,
    RawHeaders,
    error_body,
    forward_block,
    response_lines,
)

__all__ = [
    "Admission",
    "Guard",
    "InferenceLane",
    "LaneExchange",
    "PREFIX",
    "Refusal",
]

log = logging.getLogger(__name__)

PREFIX = b"/v1/infer/"
OPENAI_TARGETS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"})
"""The OpenAI surface's POST paths, served by the lane too (the body names the model)."""
MAX_HEAD = 64 * 1024
HIGH_WATER = 64 * 1024
KEEPALIVE_S = 75.0  # aiohttp's keepalive_timeout
SWEEP_S = 5.0
LINGER_S = 10.0  # aiohttp's lingering_time
_REGION = REGION_HEADER.lower().encode()
_TENANT = TENANT_HEADER.lower().encode()
_SESSION = SESSION_HEADER.lower().encode()
_PREFIX_KEY = PREFIX_HEADER.lower().encode()
_PRIORITY = PRIORITY_HEADER.lower().encode()
_COOKIE_NAME = SESSION_COOKIE + "="
_NO_BODY_STATUS = frozenset({204, 304})
_JSON = b"Content-Type: application/json; charset=utf-8\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Admission(NamedTuple):
    """The guard lets a request in: its tenant (None: the request's own X-Cpn-Tenant),
    headers for its answer (X-Request-Id), the caller's token id and the request's id."""

    tenant: str | None
    headers: Extra
    token_id: str | None = None
    request_id: str = ""


class Refusal(NamedTuple):
    """The guard turns a request away with this JSON error."""

    status: int
    code: str
    message: str
    field: str | None
    headers: Extra


class Guard(Protocol):
    """What stands in front of the proxy in the lane, as the API's middlewares do in aiohttp."""

    def admit(self, headers: Mapping[bytes, bytes]) -> Admission | Refusal:
        """Let the request in or not; `headers` maps lower-case names to values."""

    def done(self, method: str, status: int) -> None:
        """The request was answered with `status` (0: the client left first)."""


class _State(enum.Enum):
    HEAD = 1  # between requests, or reading a head
    BODY = 2  # reading a body
    SERVING = 3  # a request is being answered; bytes that arrive wait in the buffer
    GONE = 4  # handed to aiohttp, or closed
    LINGER = 5  # refused a body it did not read: reading and dropping it, then closing


_date_cache: tuple[int, bytes] = (0, b"")


def _date_line() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, b"Date: %s\r\n" % email.utils.formatdate(now, usegmt=True).encode())
    return _date_cache[1]


class LaneExchange:
    """One request read by the lane, and its answer (routing.gateway.proxy's Exchange)."""

    __slots__ = (
        "conn",
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
        "raw",
        "headers",
        "body",
        "size",
        "too_large",
        "complete",
        "status",
        "chunked_out",
        "extra",
        "http11",
        "keep_alive",
        "openai",
        "token_id",
        "request_id",
        "priority_header",
    )

    def __init__(self, conn: _LaneConnection, method: str, target: bytes, service: str) -> None:
        self.conn = conn
        self.method = method
        self.path = target.partition(b"?")[0].decode("utf-8", "surrogateescape")
        self.service = service
        self.openai = not service  # an OpenAI path at the root: the body names the model
        self.tail = target[len(PREFIX) + len(service) + 1 :] if service else target[1:]
        self.token_id: str | None = None
        self.request_id = ""
        self.priority_header: str | None = None
        self.region_hint = ""
        self.remote = conn.remote
        self.tenant = DEFAULT_TENANT
        self.session_key: str | None = None
        self.prefix_header: str | None = None
        self.idempotent = method in IDEMPOTENT_METHODS
        self.raw: list[tuple[bytes, bytes]] = []
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.too_large = False
        self.complete = False
        self.status = 0  # of the answer, once one started
        self.chunked_out = False
        self.extra: Extra = ()  # the guard's headers for the answer
        self.http11 = True
        self.keep_alive = True

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append((name, value))
        lower = name.lower()
        seen = self.headers.get(lower)
        self.headers[lower] = value if seen is None else seen + b", " + value

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.conn.lane.max_body_bytes():
            self.too_large = True
            self.body.clear()
        elif not self.too_large:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def headers_read(self, parser: httptools.HttpRequestParser) -> None:
        """The head was parsed: the request's fields, from its headers."""
        headers = self.headers
        region = headers.get(_REGION)
        if region is not None:
            self.region_hint = region.decode("latin-1").strip()
        tenant = headers.get(_TENANT)
        if tenant is not None:
            self.tenant = tenant.decode("latin-1").strip() or DEFAULT_TENANT
        session = headers.get(_SESSION)
        if session:
            self.session_key = session.decode("latin-1")
        else:
            cookie = headers.get(b"cookie")
            if cookie is not None:
                self.session_key = _cookie(cookie.decode("latin-1"), _COOKIE_NAME)
        prefix = headers.get(_PREFIX_KEY)
        if prefix is not None:
            self.prefix_header = prefix.decode("latin-1")
        priority = headers.get(_PRIORITY)
        if priority is not None:
            self.priority_header = priority.decode("latin-1")
        if b"idempotency-key" in headers:
            self.idempotent = True
        self.http11 = parser.get_http_version() == "1.1"
        self.keep_alive = parser.should_keep_alive()

    # -- the Exchange's request side ----------------------------------------------------------

    def forward_headers(self, drop: frozenset[bytes] = frozenset()) -> bytes:
        conn = self.conn
        host = self.headers.get(b"host") or conn.local
        return forward_block(self.raw, self.remote, conn.scheme, host, drop)

    async def read_body(self, limit: int) -> bytes | None:  # noqa: ARG002
        # `limit`: the connection counted the body against it while reading (on_body)
        if self.too_large:
            return None
        body = self.body
        return body[0] if len(body) == 1 else b"".join(body)

    # -- the answer -----------------------------------------------------------------------------

    def _head(self, status: int, reason: str, lines: bytes, extra: Extra) -> list[bytes]:
        self.status = status
        conn = self.conn
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, reason.encode("latin-1", "replace")),
            lines,
            _header_lines(extra),
            _header_lines(self.extra),  # the guard's
        ]
        if conn.closing or not self.keep_alive:
            head.append(b"Connection: close\r\n")
        elif not self.http11:
            head.append(b"Connection: keep-alive\r\n")
        return head

    def refuse(
        self, status: int, code: str, message: str, field: str | None, headers: Extra = ()
    ) -> None:
        if self.openai:
            body = openai_error_body(status, code, message, field)
        else:
            body = error_body(code, message, field)
        head = self._head(status, http.HTTPStatus(status).phrase, _JSON, headers)
        head.append(_date_line())
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        head.append(body)
        self.conn.write(b"".join(head))

    async def answer(
        self, status: int, reason: str, headers: RawHeaders, extra: Extra, body: bytes
    ) -> bool:
        head = self._head(status, reason, response_lines(headers), extra)
        if not _has_date(headers):
            head.append(_date_line())
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        head.append(body)
        conn = self.conn
        conn.write(b"".join(head))
        return await conn.drain()

    async def start(
        self, status: int, reason: str, headers: RawHeaders, extra: Extra, length: int | None
    ) -> bool:
        conn = self.conn
        framing = b""
        if self.method == "HEAD" or status < 200 or status in _NO_BODY_STATUS:
            if length is not None and self.method == "HEAD":
                framing = b"Content-Length: %d\r\n" % length
        elif length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif self.http11:
            framing = b"Transfer-Encoding: chunked\r\n"
            self.chunked_out = True
        else:  # HTTP/1.0 without a length: the body ends where the connection does
            conn.closing = True
        head = self._head(status, reason, response_lines(headers), extra)
        if not _has_date(headers):
            head.append(_date_line())
        head.append(framing)
        head.append(b"\r\n")
        conn.write(b"".join(head))
        return await conn.drain()

    async def send(self, chunk: bytes) -> bool:
        conn = self.conn
        if self.chunked_out:
            conn.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        else:
            conn.write(chunk)
        return await conn.drain()

    async def finish(self) -> None:
        if self.chunked_out:
            self.conn.write(b"0\r\n\r\n")

    def cut(self) -> None:
        self.conn.closing = True
        transport = self.conn.transport
        if transport is not None:
            transport.close()


def _header_lines(pairs: Extra) -> bytes:
    """(name, value) pairs as CRLF-terminated header lines."""
    return b"".join([_name_prefix(n) + v.encode("latin-1", "replace") + b"\r\n" for n, v in pairs])


@functools.lru_cache(maxsize=256)
def _name_prefix(name: str) -> bytes:
    """b"Name: ", kept: the names are the proxy's and the guard's few."""
    return name.encode() + b": "


def _has_date(headers: RawHeaders) -> bool:
    for name, _ in headers:
        if len(name) == 4 and name.lower() == b"date":
            return True
    return False


def _cookie(header: str, prefix: str) -> str | None:
    """The value of one cookie in a Cookie header (`prefix` is "name=")."""
    for part in header.split(";"):
        part = part.strip()
        if part.startswith(prefix):
            value = part[len(prefix) :]
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            return value or None
    return None


def _lane_target(line: bytes) -> tuple[str, bytes, str] | None:
    """(method, target, service) when the request line is one the lane serves, else None."""
    parts = line.split(b" ")
    if len(parts) != 3:
        return None
    method, target, _ = parts
    if method == b"POST" and target.partition(b"?")[0] in OPENAI_TARGETS:
        return "POST", target, ""
    # find, not `in`: bytes' `in` makes and drops a TypeError each time
    if not target.startswith(PREFIX) or method == b"CONNECT" or target.find(b"/.") >= 0:
        return None
    service, slash, _ = target[len(PREFIX) :].partition(b"/")
    if (
        not slash
        or not service
        or service.find(b"%") >= 0
        or service.find(b"?") >= 0
        or service.find(b"#") >= 0
    ):
        return None
    try:
        return method.decode("ascii"), target, service.decode("ascii")
    except UnicodeDecodeError:
        return None


def _maybe_lane(buf: bytes) -> bool:
    """Could a request whose head starts with `buf` (not yet whole) be one for the lane?"""
    space = buf.find(b" ", 0, 24)
    if space < 0:
        return len(buf) < 24
    target = buf[space + 1 : space + 1 + len(PREFIX)]
    if PREFIX.startswith(target):
        return True
    rest = buf[space + 1 :]
    return any(path.startswith(rest[: len(path)]) for path in OPENAI_TARGETS)


class _LaneConnection(asyncio.Protocol):
    """One client connection while the lane reads it."""

    def __init__(self, lane: InferenceLane) -> None:
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.state = _State.HEAD
        self.parser: httptools.HttpRequestParser | None = None
        self.exchange: LaneExchange | None = None
        self.remaining = 0  # Content-Length bytes of the body still to read
        self.chunked = False
        self.closing = False  # close once the request in hand is answered
        self.lost = False  # the connection is gone
        self.read_paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.since = 0.0  # when it last started waiting for a request (loop time)
        self.remote: str | None = None
        self.local = b""
        self.scheme = lane.scheme

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple) and len(local) >= 2:
            host = str(local[0])
            self.local = (f"[{host}]:{local[1]}" if ":" in host else f"{host}:{local[1]}").encode()
        self.since = self.lane.loop.time()
        self.lane.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        del exc  # a lost client is no error of ours
        self.lost = True
        self.state = _State.GONE
        self.lane.connections.discard(self)
        drained = self.drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drained = self.drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.state is _State.LINGER:
            self.remaining -= len(data)
            if not self.chunked and self.remaining <= 0 and self.transport is not None:
                self.state = _State.GONE
                self.transport.close()
            return
        self.buf = self.buf + data if self.buf else data
        if self.state is _State.SERVING:
            if len(self.buf) > HIGH_WATER and not self.read_paused and self.transport:
                self.read_paused = True
                self.transport.pause_reading()
            return
        self._advance()

    def eof_received(self) -> bool | None:
        if self.state is _State.HEAD and not self.buf and self.transport is not None:
            self.transport.close()
        return None  # asyncio closes the transport once this returns (a request in hand ends)

    # -- writing ----------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.lost and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> bool:
        """Wait while the client reads slower than we write; False when it left."""
        if self.write_paused and not self.lost:
            self.drained = asyncio.get_running_loop().create_future()
            await self.drained
            self.drained = None
        return not self.lost

    # -- reading ----------------------------------------------------------------------------------

    def _advance(self) -> None:
        while self.buf or self.state is _State.BODY:
            if self.state is _State.HEAD:
                if not self._read_head():
                    return
            elif self.state is _State.BODY:
                if not self._read_body():
                    return
            else:
                return

    def _read_head(self) -> bool:
        """Read one head from the buffer if it is all there; True to go on reading."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if not _maybe_lane(buf):
                self._hand_off()
            elif len(buf) > MAX_HEAD:
                self._refuse_and_close(431, "head_too_large", f"request head over {MAX_HEAD} bytes")
            return False
        line_end = buf.find(b"\r\n")
        found = _lane_target(buf[:line_end])
        if found is None:
            self._hand_off()
            return False
        method, target, service = found
        exchange = LaneExchange(self, method, target, service)
        parser = self.parser
        if parser is None:
            parser = self.parser = httptools.HttpRequestParser(self)
        self.exchange = exchange
        self.chunked = False
        self.remaining = 0
        try:
            parser.feed_data(buf[: end + 4])
        except httptools.HttpParserError:  # Upgrade too: aiohttp answers as it always did
            self.exchange = None
            self._hand_off()
            return False
        self.buf = buf[end + 4 :]
        exchange.headers_read(parser)
        limit = self.lane.max_body_bytes()
        if exchange.complete:
            self._dispatch()
            return True
        length = exchange.headers.get(b"content-length")
        self.chunked = length is None
        if length is not None:
            self.remaining = int(length)  # llhttp checked it is a number
            if self.remaining > limit:
                exchange.too_large = True
                self.closing = True  # the body is never read
                self._dispatch()
                return False
        if exchange.headers.get(b"expect", b"").lower() == b"100-continue":
            self.write(_CONTINUE)
        self.state = _State.BODY
        return True

    def _read_body(self) -> bool:
        """Feed body bytes to the parser; True once the request was dispatched."""
        exchange = self.exchange
        parser = self.parser
        assert exchange is not None and parser is not None
        if not self.buf:
            return False
        if self.chunked:
            data, self.buf = self.buf, b""
        else:
            take = min(self.remaining, len(self.buf))
            data, self.buf = self.buf[:take], self.buf[take:]
            self.remaining -= take
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.exchange = None
            self._refuse_and_close(400, "malformed", f"bad request body: {exc}")
            return False
        if exchange.too_large:
            self.closing = True
            self.buf = b""
            self._dispatch()
            return False
        if exchange.complete:
            self._dispatch()
            return True
        return False

    def on_message_begin(self) -> None:
        if self.exchange is not None and self.exchange.complete:
            # a pipelined request right after a chunked body: where it starts is lost
            self.closing = True

    def on_url(self, url: bytes) -> None:
        pass  # the lane read the request line itself

    # the parser's callbacks after the request's end belong to a pipelined one: dropped, and
    # the connection closes after this answer (on_message_begin)

    def on_header(self, name: bytes, value: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.complete:
            exchange.on_header(name, value)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.complete:
            exchange.on_body(body)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.on_message_complete()

    # -- serving ----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        exchange = self.exchange
        assert exchange is not None
        self.state = _State.SERVING
        self.lane.loop.create_task(self._serve(exchange))

    async def _serve(self, exchange: LaneExchange) -> None:
        lane = self.lane
        try:
            guard = lane.guard
            admitted = guard.admit(exchange.headers) if guard else None
            if isinstance(admitted, Refusal):
                exchange.extra = admitted.headers
                exchange.refuse(admitted.status, admitted.code, admitted.message, admitted.field)
            else:
                if admitted is not None:
                    exchange.extra = admitted.headers
                    exchange.token_id = admitted.token_id
                    exchange.request_id = admitted.request_id
                    if admitted.tenant is not None:
                        exchange.tenant = admitted.tenant
                proxy = lane.proxy()
                if proxy is None:
                    exchange.refuse(503, "starting", "the inference gateway is not ready", None)
                else:
                    await proxy.serve(exchange)
        except Exception:
            log.exception("%s %s: the inference lane failed", exchange.method, exchange.path)
            if exchange.status == 0 and not self.lost:
                exchange.refuse(500, "internal", "the broker failed this request", None)
            else:
                self.closing = True
        finally:
            try:
                if lane.guard is not None:
                    lane.guard.done(exchange.method, exchange.status)
            finally:
                self._next(exchange)

    def _next(self, exchange: LaneExchange) -> None:
        """The answer is out: close, or read the next request."""
        self.exchange = None
        if self.lost:
            return
        transport = self.transport
        assert transport is not None
        if exchange.too_large:
            self._linger()
            return
        if self.closing or not exchange.keep_alive:
            self.state = _State.GONE
            transport.close()
            return
        self.state = _State.HEAD
        self.since = self.lane.loop.time()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        if self.buf:
            self._advance()

    def _linger(self) -> None:
        """After a 413: read and drop what the client still sends of the body (up to its
        Content-Length, for at most LINGER_S), then close; closing at once would reset the
        connection under a client still sending, and it might never read the answer."""
        transport = self.transport
        assert transport is not None
        self.state = _State.LINGER
        self.buf = b""
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        if not self.chunked and self.remaining <= 0:
            self.state = _State.GONE
            transport.close()
            return
        self.lane.loop.call_later(LINGER_S, transport.close)

    def _refuse_and_close(self, status: int, code: str, message: str) -> None:
        body = error_body(code, message, None)
        self.write(
            b"HTTP/1.1 %d %s\r\n%sContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (status, http.HTTPStatus(status).phrase.encode(), _JSON, len(body), body)
        )
        if self.lane.guard is not None:
            self.lane.guard.done("-", status)
        self.state = _State.GONE
        self.buf = b""
        if self.transport is not None:
            self.transport.close()

    def _hand_off(self) -> None:
        """From here on, aiohttp serves this connection (with what was read of it)."""
        transport = self.transport
        assert transport is not None
        self.state = _State.GONE
        self.lane.connections.discard(self)
        handler = self.lane.fallback()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self.buf = self.buf, b""
        if data:
            handler.data_received(data)

    def idle_for(self, now: float) -> float:
        """Seconds spent waiting for (the rest of) a request head; 0 while one is served."""
        return now - self.since if self.state is _State.HEAD else 0.0


class InferenceLane:
    """The listener's protocol factory: `loop.create_server(lane, ...)` (see broker.server)."""

    def __init__(
        self,
        *,
        fallback: Callable[[], asyncio.Protocol],
        proxy: Callable[[], InferenceProxy | None],
        guard: Guard | None = None,
        scheme: str = "http",
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        """`fallback` makes aiohttp's protocol (an aiohttp web.Server); `proxy` returns the
        gateway's proxy (None while it starts)."""
        self.fallback = fallback
        self.proxy = proxy
        self.guard = guard
        self.scheme = scheme
        self.keepalive_s = keepalive_s
        self.connections: set[_LaneConnection] = set()
        self.loop = asyncio.get_running_loop()
        self._sweeper: asyncio.TimerHandle | None = self.loop.call_later(SWEEP_S, self._sweep)

    def __call__(self) -> _LaneConnection:
        return _LaneConnection(self)

    def max_body_bytes(self) -> int:
        proxy = self.proxy()
        return proxy.max_body_bytes if proxy is not None else 0

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            if conn.idle_for(now) > self.keepalive_s and conn.transport is not None:
                conn.transport.close()
        self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)

    async def close(self, timeout_s: float) -> None:
        """Close idle connections now, and the others once their answer is out (at most
        `timeout_s`, then they are dropped)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        deadline = self.loop.time() + timeout_s
        while True:
            for conn in list(self.connections):
                conn.closing = True
                if conn.state is _State.HEAD and conn.transport is not None:
                    conn.transport.close()
            if not self.connections or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
