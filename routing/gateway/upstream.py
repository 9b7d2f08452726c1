"""A lean HTTP/1.1 client for the proxy's upstream hop: keep-alive pool, llhttp parser.

aiohttp.ClientSession does far more per request than a proxy hop needs (URL objects, a
request and a response object with cookie jars, traces, payload wrappers, default headers,
timer contexts): in the broker's profile it was about a third of the CPU per proxied request.
This client does one thing: send an already framed request on a pooled connection and hand
back the status, the raw headers and the body as it arrives.

- Connections are kept per (scheme, host, port, source address), last used first; an idle one
  closes after `keepalive_s` (checked when the pool is touched) or when the peer closes it.
- Responses are parsed by httptools (llhttp, the parser Node.js uses): Content-Length,
  chunked (decoded; the proxy's own server re-frames) and read-until-close bodies; 1xx
  interim answers are skipped; an answer to HEAD ends at its headers.
- Timeouts: `connect_timeout_s` for the TCP (and TLS) connect, `response_timeout_s` for the
  response headers and again for each gap between body chunks. The response timeouts are
  deadlines that one sweep of the pool checks every `TICK_S` while any request waits (a timer
  per request, set and cancelled, cost 3 us of each): one fires up to TICK_S late.
- Errors: `UpstreamConnectError` (an OSError: refused, unreachable, connect timeout; nothing
  was sent), `TimeoutError` (no headers, or a stalled body), `UpstreamBroken` (a
  ConnectionError: the connection failed or the answer did not parse).
- Like aiohttp, a request with an idempotent method (RFC 9110 9.2.2) that fails on a reused
  connection before any byte of its answer arrived is sent once more on a new connection: the
  peer may have closed the idle connection just as it was reused.
- Flow control: reading from the upstream pauses while more than `HIGH_WATER` bytes of body
  wait for the proxy to pass them on, and resumes below `LOW_WATER`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import httptools
from mypy_extensions import mypyc_attr

__all__ = [
    "HIGH_WATER",
    "LOW_WATER",
    "Origin",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamPool",
    "UpstreamResponse",
    "parse_origin",
]

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
KEEPALIVE_S = 15.0
TICK_S = 0.05
# RFC 9110 9.2.2: methods whose request may be repeated with the same effect
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
# aiohttp's rule: a request without a body says Content-Length: 0 unless its method has no body
_NO_BODY_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})

RawHeaders = Sequence[tuple[bytes, bytes]]


@mypyc_attr(native_class=False)  # mypyc: a subclass of OSError stays a Python class
class UpstreamConnectError(OSError):
    """The connection could not be made (refused, unreachable, timed out): nothing was sent."""


@mypyc_attr(native_class=False)
class UpstreamBroken(ConnectionError):
    """The connection failed, or the answer did not parse, after the request was (maybe) sent."""


class Origin(NamedTuple):
    """Where an upstream's base URL points: one pool key (with the source address)."""

    scheme: str  # "http" or "https"
    host: str
    port: int
    host_header: bytes  # the Host header's value
    prefix: bytes  # the base URL's path, without a trailing slash ("" or "/v2")


_ORIGINS: dict[str, Origin] = {}


def parse_origin(base_url: str) -> Origin:
    """`http[s]://host[:port][/prefix]` -> its Origin (cached: a handful of URLs repeat)."""
    origin = _ORIGINS.get(base_url)
    if origin is not None:
        return origin
    scheme, sep, rest = base_url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    authority, slash, path = rest.partition("/")
    authority = authority.rpartition("@")[2]  # no credentials on this hop
    if not authority:
        raise ValueError(f"no host in {base_url!r}")
    default = 443 if scheme == "https" else 80
    if authority.startswith("["):  # [v6]:port
        host, _, port_text = authority[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = authority.rpartition(":") if ":" in authority else (authority, "", "")
    port = int(port_text) if port_text else default
    prefix = ("/" + path).rstrip("/") if slash else ""
    # Host as aiohttp wrote it: the port only where it is not the scheme's default
    bracketed = f"[{host}]" if ":" in host else host
    host_header = bracketed if port == default else f"{bracketed}:{port}"
    origin = Origin(scheme, host, port, host_header.encode("idna"), prefix.encode())
    if len(_ORIGINS) < 4096:
        _ORIGINS[base_url] = origin
    return origin


class UpstreamResponse:
    """One answer: `status`, `reason`, `headers` (raw, as received), the body via `read_any`.

    `release()` when done hands the connection back to the pool if the whole body arrived
    (read or not), else closes it; `close()` always closes it."""

    __slots__ = (
        "_conn",
        "_waiter",
        "_pool",
        "_loop",
        "_timeout_s",
        "chunks",
        "buffered",
        "complete",
        "exception",
        "headers",
        "reason",
        "status",
        "content_length",
        "chunked",
    )

    def __init__(
        self,
        conn: _Connection,
        status: int,
        reason: str,
        headers: list[tuple[bytes, bytes]],
        timeout_s: float,
    ) -> None:
        self._conn: _Connection | None = conn
        self._pool = conn.pool
        self._loop = conn.loop
        self._waiter: asyncio.Future[None] | None = None
        self._timeout_s = timeout_s
        self.status = status
        self.reason = reason
        self.headers = headers
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False  # the whole body is here (maybe still in `chunks`)
        self.exception: BaseException | None = None
        self.content_length: int | None = None
        self.chunked = False

    def at_eof(self) -> bool:
        """The body ended and every byte of it was read."""
        return self.complete and not self.chunks

    def whole_body(self) -> bytes | None:
        """The body, if all of it is already here, its length was declared, nothing failed,
        and nothing of it was read yet; else None (then read it with `read_any`)."""
        if not self.complete or self.exception is not None or self.content_length is None:
            return None
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        return body

    async def read_any(self) -> bytes:
        """The next piece of body as it arrived (b"" at the end); TimeoutError after
        `response_timeout_s` without a byte, UpstreamBroken when the connection failed."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                conn = self._conn
                if conn is not None and conn.paused and self.buffered < LOW_WATER:
                    conn.resume()
                return chunk
            if self.exception is not None:
                raise self.exception
            if self.complete:
                return b""
            waiter = self._waiter = self._loop.create_future()
            pool = self._pool
            pool.watch(waiter, self._timeout_s, "no body bytes in time")
            try:
                await waiter
            finally:
                pool.unwatch(waiter)
                self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def feed_data(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not self.complete:
            self.exception = exc
            self._wake()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.complete and self.exception is None:  # unread bytes of it are dropped
            self.chunks.clear()
            self.buffered = 0
            conn.done(self)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, pool: UpstreamPool, key: _Key) -> None:
        self.pool = pool
        self.key = key
        # the loop it runs on, asked once: asyncio.get_running_loop() is a getpid() system call
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.reused = False
        self.paused = False
        self.closed = False
        self.keep_alive = True
        self.head = False  # the request in flight is a HEAD: its answer ends at the headers
        self.got_bytes = False
        self.timeout_s = 0.0
        self.waiter: asyncio.Future[UpstreamResponse] | None = None
        self.response: UpstreamResponse | None = None
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []

    # asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not an isinstance check: uvloop's transports are not asyncio.Transport's
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.waiter is None and self.response is None:
            self.close()  # bytes nobody asked for on an idle connection
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._lost(UpstreamBroken(f"bad HTTP answer: {exc!r}"))
            self.close()

    def eof_received(self) -> bool | None:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response = self.response
        if (
            exc is None
            and response is not None
            and not response.complete
            and response.content_length is None
            and not response.chunked
            and not self.head
        ):
            response.feed_eof()  # a body delimited by the connection's close
            return
        self._lost(UpstreamBroken(f"connection lost: {exc}" if exc else "connection closed"))

    def pause_writing(self) -> None:  # the request is written whole; nothing to pace
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks ------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        headers, self.headers = self.headers, []
        reason, self.reason = self.reason, b""
        if 100 <= status < 200 and status != 101:
            return  # an interim answer (100 Continue): the real one follows
        self.keep_alive = parser.should_keep_alive() and not self.head and status != 101
        response = UpstreamResponse(self, status, reason.decode("latin-1"), headers, self.timeout_s)
        for name, value in headers:
            if len(name) == 14 and name.lower() == b"content-length":
                try:
                    response.content_length = int(value)
                except ValueError:
                    pass
            elif len(name) == 17 and name.lower() == b"transfer-encoding":
                # find, not `in`: bytes' `in` makes and drops a TypeError each time
                response.chunked = value.lower().find(b"chunked") >= 0
        self.response = response
        if self.head or status in (204, 304, 101):
            # no body follows; after a HEAD llhttp would wait for the one Content-Length
            # names, after a 101 the connection is no longer HTTP: neither is reused
            response.feed_eof()
        waiter = self.waiter
        self.waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None and not response.complete:
            response.feed_data(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and not response.complete:
            response.feed_eof()

    # used by the pool and the response ----------------------------------------------------

    def send(self, data: bytes, head: bool, timeout_s: float) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        loop = self.loop
        self.head = head
        self.timeout_s = timeout_s
        self.got_bytes = False
        self.response = None
        waiter = self.waiter = loop.create_future()
        self.transport.write(data)
        return waiter

    def _lost(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.response is not None:
            self.response.fail(exc)

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def done(self, response: UpstreamResponse) -> None:
        """The answer was read whole: back to the pool when both ends keep the connection."""
        if self.response is response:
            self.response = None
        if self.closed or not self.keep_alive or self.paused:
            self.close()
        else:
            self.pool.put_back(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()
        self._lost(UpstreamBroken("connection closed"))


class _Key(NamedTuple):
    scheme: str
    host: str
    port: int
    source_ip: str | None


class UpstreamPool:
    """Keep-alive connections to the proxy's upstreams, any number per (origin, source)."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[_Key, collections.deque[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        # response waits in progress -> (deadline on the loop's clock, the timeout's message)
        self._deadlines: dict[asyncio.Future[Any], tuple[float, str]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self.connections_made = 0

    def idle(self) -> int:
        """Idle connections held now."""
        return sum(len(d) for d in self._idle.values())

    async def request(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: bytes,
        body: bytes,
        *,
        source_ip: str | None = None,
        connect_timeout_s: float,
        response_timeout_s: float,
    ) -> UpstreamResponse:
        """Send `method target` with `headers` (CRLF-terminated lines, without Host and
        Content-Length, which this adds) and `body`; the answer once its headers arrived."""
        head = [method, b" ", target, b" HTTP/1.1\r\nHost: ", origin.host_header, b"\r\n", headers]
        if body or method not in _NO_BODY_METHODS:
            head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        if body:
            head.append(body)
        data = b"".join(head)
        key = _Key(origin.scheme, origin.host, origin.port, source_ip)
        is_head = method == b"HEAD"
        conn = self._get(key)
        if conn is not None and method in _IDEMPOTENT:
            try:
                return await self._send(conn, data, is_head, response_timeout_s)
            except UpstreamBroken:
                if conn.got_bytes:
                    raise
            conn = None  # the peer closed the idle connection as it was reused: once more
        if conn is None:
            conn = await self._connect(key, connect_timeout_s)
        return await self._send(conn, data, is_head, response_timeout_s)

    async def _send(
        self, conn: _Connection, data: bytes, head: bool, timeout_s: float
    ) -> UpstreamResponse:
        self._busy.add(conn)
        waiter = conn.send(data, head, timeout_s)
        self.watch(waiter, timeout_s, "no response headers in time")
        try:
            return await waiter
        except TimeoutError:
            conn.close()
            raise
        except asyncio.CancelledError:
            conn.close()
            raise
        finally:
            self.unwatch(waiter)

    def watch(self, waiter: asyncio.Future[Any], timeout_s: float, message: str) -> None:
        """Fail `waiter` with TimeoutError(message) unless it is done within `timeout_s`
        (give or take TICK_S); `unwatch` it when done."""
        loop = waiter.get_loop()
        self._deadlines[waiter] = (loop.time() + timeout_s, message)
        if self._sweeper is None:
            self._sweeper = loop.call_later(TICK_S, self._sweep)

    def unwatch(self, waiter: asyncio.Future[Any]) -> None:
        self._deadlines.pop(waiter, None)

    def _sweep(self) -> None:
        deadlines = self._deadlines
        loop = asyncio.get_running_loop()
        now = loop.time()
        late = [w for w, (deadline, _) in deadlines.items() if deadline <= now or w.done()]
        for waiter in late:
            _, message = deadlines.pop(waiter)
            if not waiter.done():
                waiter.set_exception(TimeoutError(message))
        self._sweeper = loop.call_later(TICK_S, self._sweep) if deadlines else None

    def _get(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.close()
                continue
            if now - conn.idle_since > self.keepalive_s:
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def put_back(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        now = time.monotonic()
        conn.idle_since = now
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = collections.deque()
        while idle and now - idle[0].idle_since > self.keepalive_s:
            idle.popleft().close()  # the oldest idle ones, past their keep-alive
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle:
            try:
                idle.remove(conn)
            except ValueError:
                pass

    async def _connect(self, key: _Key, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context: ssl.SSLContext | None = None
        if key.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key),
                    key.host,
                    key.port,
                    ssl=ssl_context,
                    local_addr=None if key.source_ip is None else (key.source_ip, 0),
                )
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {key.host}:{key.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(
                exc.errno, f"cannot connect to {key.host}:{key.port}: {exc.strerror or exc}"
            ) from None
        self.connections_made += 1
        return conn

    async def close(self) -> None:
        """Close every connection, idle or busy."""
        for conn in [*self._busy, *[c for d in self._idle.values() for c in d]]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await asyncio.sleep(0)  # let the transports run their connection_lost
