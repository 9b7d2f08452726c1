"""WAN emulation: a fake wide-area network for a federation that runs on one machine.

This is an EMULATION. Every site of a demo federation runs on this host, on loopback, and the
kernel offers no netem; so delay is added in user space by a TCP relay. It stands in for the one
thing the machine cannot have (a WAN) and must never sit in a real deployment's data path.

Address plan (docs/wan-emulation.md): each node (a site, a client region) owns a loopback IP,
e.g. 127.0.1.N, and its processes bind both their listening sockets and their outgoing
connections to it. For every service a node serves, the emulator listens on a front address
(127.0.2.N, same port) and relays to the real backend. A connection's source node is found from
its peer IP (`node_of_ip`); both directions of the relay then hold every chunk for
rtt(source, node) / 2, so an application-level round trip through the front takes the RTT.

What is emulated: per-path RTT, split evenly over the two directions, with byte order kept per
direction; and, where `bandwidth_mbps` gives one, per-path bandwidth: every connection from
node a to node b shares one `Link` per direction, which serializes their bytes at its rate
(round robin between connections, a quantum each) before the delay line. What is not: the TCP
handshake (connect() returns at loopback speed), loss, jitter, TCP's slow start. A peer IP
that maps to no node gets no delay and no shaping (logged once per IP at debug, counted in
`stats()`).

Shaping is paced with timers, never a busy loop (sites.emulation.shaping): a late timer costs
no throughput, and the delay of an idle path stays exact (a small message adds only its
serialization time, ~30 us for 130 bytes at 35 Mbit/s).

Past 600 lines: the pipe, the connection and the two protocols share one connection's private
state (transports, pause flags, half-close bookkeeping); apart, each would reach into the
others. The shaping, which only takes and delivers chunks, lives in its own module.

The RTT is read once per connection, when it is accepted. The backend connection is bound to the
client's IP where possible, so the backend sees the real source as it would over a WAN.

Timers: asyncio's default loop fires timers up to 1 ms late per direction - 40 % of a 5 ms
link. Run the emulator on `new_event_loop()` (`run(main())`), whose timers are precise to tens
of microseconds (sites.emulation.timers, exported here too).

Backpressure: each direction holds at most `max_queued_bytes` (waiting for its link and in its
delay line); past that it stops reading its source until the queue drains to half. Like a TCP
window, this caps one connection's throughput at about max_queued_bytes / (rtt / 2): above a
shaped rate as long as max_queued_bytes > rate * rtt / 2 (4 MiB: 335 Mbit/s at 100 ms). A
destination that pauses writing (its reader is slow) holds the delay line, and so, through the
cap, the source.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict

from sites.emulation.shaping import Link
from sites.emulation.timers import PreciseEventLoop, new_event_loop, run

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_BYTES = 4 * 1024 * 1024
UNREACHABLE_LOG_S = 30.0
"""A backend that refuses connections is logged at most once per this many seconds, with the
count since (peers probe a stopped agent several times a second: each probe was a line)."""


class RouteStats(TypedDict):
    node: str
    backend: str
    connections: int
    active: int
    bytes_to_backend: int
    bytes_to_client: int
    connect_errors: int


class LinkStats(TypedDict):
    src: str
    dst: str
    mbps: float
    bytes: int
    busy_s: float


class WanStats(TypedDict):
    connections: int
    active: int
    unknown_source: int
    routes: dict[str, RouteStats]
    links: dict[str, LinkStats]


def _hostport(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


@dataclass
class _Route:
    node: str
    front: tuple[str, int]
    backend: tuple[str, int]
    server: asyncio.Server | None = None
    connections: int = 0
    active: int = 0
    bytes_to_backend: int = 0
    bytes_to_client: int = 0
    connect_errors: int = 0
    warned_at: float = -math.inf  # when its unreachable backend was last logged
    unlogged_errors: int = 0  # connect errors since then


def _unreachable(route: _Route, exc: OSError) -> None:
    route.connect_errors += 1
    route.unlogged_errors += 1
    now = time.monotonic()
    if now - route.warned_at < UNREACHABLE_LOG_S:
        return
    more = route.unlogged_errors - 1
    logger.warning(
        "WAN: backend %s unreachable: %s%s",
        _hostport(route.backend),
        exc,
        f" ({more} more since the last report)" if more else "",  # none before the first
    )
    route.warned_at, route.unlogged_errors = now, 0


class _Pipe:
    """One direction of one relayed connection: a delay line that keeps byte order.

    Each chunk is stamped with its due time on arrival and written when that time comes;
    the delay is constant per connection, so due times never decrease and order is kept.
    A `None` chunk is the end of stream; `close_after` says whether the destination is then
    closed (the source is gone) or half-closed (the source sent EOF). With a `link`, chunks
    first wait in a backlog for their turn on it, which stamps them (`take`, `deliver`).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        delay_s: float,
        high_water: int,
        on_bytes: Callable[[int], None],
        on_end: Callable[[bool], None],
        link: Link | None = None,
    ) -> None:
        self._loop = loop
        self._delay_s = delay_s
        self._link = link
        self._backlog: collections.deque[bytes | memoryview | None] = collections.deque()
        self.in_link = False  # in its link's round robin
        self._high = high_water
        self._low = high_water // 2
        self._on_bytes = on_bytes
        self._on_end = on_end
        self._queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self._queued = 0
        self._timer: asyncio.TimerHandle | None = None
        self._ended = False  # end of stream queued
        self._close_after = False
        self._src_paused = False
        self._dst_paused = False
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None

    def feed(self, data: bytes) -> None:
        if self._ended:
            return
        self._queued += len(data)
        if self._queued >= self._high and self.src is not None and not self._src_paused:
            self._src_paused = True
            self.src.pause_reading()
        if self._link is not None:
            self._backlog.append(data)
            self._link.want(self)
            return
        self._queue.append((self._loop.time() + self._delay_s, data))
        self._kick()

    def feed_end(self, *, close: bool) -> None:
        self._close_after = self._close_after or close
        if self._ended:
            return
        self._ended = True
        if self._link is not None:
            self._backlog.append(None)
            self._link.want(self)
            return
        self._queue.append((self._loop.time() + self._delay_s, None))
        self._kick()

    def take(self, limit: int) -> tuple[bytes | None, bool]:
        """For the link: up to `limit` bytes of the backlog (b"" if empty), or None for its end
        of stream; and whether more waits."""
        backlog = self._backlog
        if backlog and backlog[0] is None:
            backlog.popleft()
            return None, bool(backlog)
        parts: list[bytes | memoryview] = []
        n = 0
        while backlog and n < limit:
            head = backlog[0]
            if head is None:
                break
            room = limit - n
            if len(head) <= room:
                parts.append(head)
                n += len(head)
                backlog.popleft()
            else:
                view = memoryview(head)
                parts.append(view[:room])
                backlog[0] = view[room:]
                n += room
        return b"".join(parts), bool(backlog)

    def deliver(self, sent_at: float, chunk: bytes | None) -> None:
        """From the link: `chunk` has left at `sent_at`; it arrives rtt / 2 later."""
        self._queue.append((sent_at + self._delay_s, chunk))
        self._kick()

    def set_dst(self, dst: asyncio.Transport) -> None:
        self.dst = dst
        self._kick()

    def pause_writing(self) -> None:
        self._dst_paused = True
        self._cancel_timer()

    def resume_writing(self) -> None:
        self._dst_paused = False
        self._kick()

    def drop(self) -> None:
        """The destination is gone: discard what is queued and stop."""
        self._cancel_timer()
        self._queue.clear()
        self._backlog.clear()  # the link drops it from its round robin at its next turn
        self._queued = 0
        self._ended = True
        self.dst = None

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _kick(self) -> None:
        if self._timer is not None or not self._queue or self.dst is None or self._dst_paused:
            return
        due = self._queue[0][0]
        if due <= self._loop.time():
            self._flush()
        else:
            self._timer = self._loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._flush()

    def _flush(self) -> None:
        dst = self.dst
        if dst is None:
            return
        now = self._loop.time()
        chunks: list[bytes] = []
        end = False
        while self._queue and self._queue[0][0] <= now:
            _, chunk = self._queue.popleft()
            if chunk is None:
                end = True
                break
            chunks.append(chunk)
        if chunks:
            data = b"".join(chunks)
            self._queued -= len(data)
            if not dst.is_closing():
                dst.write(data)
                self._on_bytes(len(data))
        if self._src_paused and self._queued <= self._low and self.src is not None:
            self._src_paused = False
            self.src.resume_reading()
        if end:
            self.dst = None
            self._on_end(self._close_after)
            return
        self._kick()


class _Connection:
    """A client connection relayed to its backend through two delay lines."""

    def __init__(
        self,
        emulator: WanEmulator,
        route: _Route,
        client: asyncio.Transport,
        delay_s: float,
        links: tuple[Link | None, Link | None] = (None, None),
    ) -> None:
        loop = asyncio.get_running_loop()
        self.emulator = emulator
        self.route = route
        self.client: asyncio.Transport | None = client
        self.backend: asyncio.Transport | None = None
        high = emulator.max_queued_bytes
        up_link, down_link = links
        self.up = _Pipe(loop, delay_s, high, self._count_up, self._end_up, up_link)
        self.down = _Pipe(loop, delay_s, high, self._count_down, self._end_down, down_link)
        self.up.src = client
        self.down.dst = client
        self.connect_task: asyncio.Task[None] | None = None
        self._up_done = False
        self._down_done = False

    def _count_up(self, n: int) -> None:
        self.route.bytes_to_backend += n

    def _count_down(self, n: int) -> None:
        self.route.bytes_to_client += n

    def _end_up(self, close: bool) -> None:
        self._up_done = True
        self._deliver_end(self.backend, close)

    def _end_down(self, close: bool) -> None:
        self._down_done = True
        self._deliver_end(self.client, close)

    def _deliver_end(self, transport: asyncio.Transport | None, close: bool) -> None:
        if self._up_done and self._down_done:
            self.abort(graceful=True)
            return
        if transport is None or transport.is_closing():
            return
        if close or not transport.can_write_eof():
            transport.close()
            return
        try:
            transport.write_eof()
        except OSError:  # the peer is already gone (ENOTCONN): nothing left to half-close
            transport.close()

    def backend_made(self, transport: asyncio.Transport) -> None:
        if self.client is None:  # the client left while we connected
            transport.abort()
            return
        self.backend = transport
        self.down.src = transport
        self.up.set_dst(transport)

    def client_lost(self) -> None:
        self.client = None
        self.down.drop()
        self._down_done = True
        if self.connect_task is not None and not self.connect_task.done():
            self.connect_task.cancel()
        if self.backend is None:
            self.up.drop()
            self._forget()
        elif self._up_done:  # the client had half-closed; nothing is left to relay
            self.abort(graceful=True)
        else:
            self.up.feed_end(close=True)

    def backend_lost(self) -> None:
        self.backend = None
        self.up.drop()
        self._up_done = True
        if self.client is None:
            self._forget()
        elif self._down_done:
            self.abort(graceful=True)
        else:
            self.down.feed_end(close=True)

    def connect_failed(self) -> None:
        self.up.drop()
        self.down.drop()
        if self.client is not None:
            self.client.abort()

    def abort(self, *, graceful: bool) -> None:
        """Close both sides; `graceful` lets queued kernel-side writes drain first."""
        self.up.drop()
        self.down.drop()
        if self.connect_task is not None and not self.connect_task.done():
            self.connect_task.cancel()
        for transport in (self.client, self.backend):
            if transport is not None and not transport.is_closing():
                if graceful:
                    transport.close()
                else:
                    transport.abort()

    def _forget(self) -> None:
        if self in self.emulator.connections:
            self.emulator.connections.discard(self)
            self.route.active -= 1


class _ClientProtocol(asyncio.Protocol):
    """The accepted side, at the front address."""

    def __init__(self, emulator: WanEmulator, route: _Route) -> None:
        self._emulator = emulator
        self._route = route
        self._conn: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):  # pragma: no cover - TCP only
            raise TypeError(f"unexpected transport {transport!r}")
        self._conn = self._emulator.accept(self._route, transport)

    def data_received(self, data: bytes) -> None:
        if self._conn is not None:
            self._conn.up.feed(data)

    def eof_received(self) -> bool:
        if self._conn is not None:
            self._conn.up.feed_end(close=False)
        return True  # keep the socket open for the other direction (half-close)

    def pause_writing(self) -> None:
        if self._conn is not None:
            self._conn.down.pause_writing()

    def resume_writing(self) -> None:
        if self._conn is not None:
            self._conn.down.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            logger.debug("WAN: client connection lost: %s", exc)
        if self._conn is not None:
            self._conn.client_lost()


class _BackendProtocol(asyncio.Protocol):
    """The emulator's connection to the real service."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):  # pragma: no cover - TCP only
            raise TypeError(f"unexpected transport {transport!r}")
        self._conn.backend_made(transport)

    def data_received(self, data: bytes) -> None:
        self._conn.down.feed(data)

    def eof_received(self) -> bool:
        self._conn.down.feed_end(close=False)
        return True

    def pause_writing(self) -> None:
        self._conn.up.pause_writing()

    def resume_writing(self) -> None:
        self._conn.up.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            logger.debug("WAN: backend connection lost: %s", exc)
        self._conn.backend_lost()


class WanEmulator:
    """Relays each route's front address to its backend, delaying by rtt(source, node) / 2
    and, where `bandwidth_mbps` gives a rate, shaping each direction of the path to it.

    `node_of_ip` maps a peer IP to its node name; `rtt_ms(src, dst)` gives the RTT between two
    node names in ms; `bandwidth_mbps(src, dst)` the Mbit/s of data from node src to node dst
    (None: not shaped), read when a connection is accepted (a changed rate applies to the
    path's link from then on). Run on `new_event_loop()` for sub-millisecond timers.
    """

    def __init__(
        self,
        *,
        node_of_ip: Mapping[str, str],
        rtt_ms: Callable[[str, str], float],
        bandwidth_mbps: Callable[[str, str], float | None] | None = None,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        preserve_source_ip: bool = True,
    ) -> None:
        if max_queued_bytes < 1:
            raise ValueError(f"max_queued_bytes must be positive, got {max_queued_bytes}")
        self._node_of_ip = dict(node_of_ip)
        self._rtt_ms = rtt_ms
        self._bandwidth_mbps = bandwidth_mbps
        self._links: dict[tuple[str, str], Link] = {}
        self.max_queued_bytes = max_queued_bytes
        self._preserve_source_ip = preserve_source_ip
        self._routes: list[_Route] = []
        self.connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._unknown_ips: set[str] = set()
        self._total = 0
        self._unknown_source = 0
        self._closed = False
        self._stopping = False
        self._warned_loop = False

    async def add_route(
        self, *, front: tuple[str, int], backend: tuple[str, int], node: str
    ) -> tuple[str, int]:
        """Listen on `front` (port 0 picks one) for `node`'s service at `backend`."""
        if self._closed:
            raise RuntimeError("WanEmulator is closed")
        loop = asyncio.get_running_loop()
        if not isinstance(loop, PreciseEventLoop) and not self._warned_loop:
            self._warned_loop = True
            logger.warning(
                "WAN emulator on %s: timers may fire up to 1 ms late per direction; "
                "use sites.emulation.wan.new_event_loop()",
                type(loop).__name__,
            )
        route = _Route(node=node, front=front, backend=backend)
        route.server = await loop.create_server(
            lambda: _ClientProtocol(self, route), front[0], front[1], reuse_address=True
        )
        host, port = route.server.sockets[0].getsockname()[:2]
        route.front = (host, port)
        self._routes.append(route)
        logger.info(
            "WAN route %s -> %s for node %s", _hostport(route.front), _hostport(backend), node
        )
        return route.front

    def accept(self, route: _Route, client: asyncio.Transport) -> _Connection | None:
        """Called by a front's protocol for each new client connection."""
        peer = client.get_extra_info("peername")
        peer_ip = str(peer[0]) if peer else ""
        delay_s = self._delay_s(peer_ip, route.node)
        if delay_s is None:
            client.abort()
            return None
        links: tuple[Link | None, Link | None] = (None, None)
        src = self._node_of_ip.get(peer_ip)
        if src is not None and self._bandwidth_mbps is not None:
            try:
                links = (self._link(src, route.node), self._link(route.node, src))
            except Exception:
                # A bad bandwidth callable must not take the emulator down; refuse this one.
                logger.exception(
                    "WAN: no bandwidth for %s <-> %s; refusing the connection", src, route.node
                )
                client.abort()
                return None
        conn = _Connection(self, route, client, delay_s, links)
        self._total += 1
        route.connections += 1
        route.active += 1
        self.connections.add(conn)
        task = asyncio.get_running_loop().create_task(
            self._connect(conn, peer_ip), name=f"wan-connect-{_hostport(route.backend)}"
        )
        conn.connect_task = task
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return conn

    def _link(self, src: str, dst: str) -> Link | None:
        """The shaped link for data from node `src` to node `dst`, its rate read now."""
        if self._bandwidth_mbps is None or src == dst:
            return None
        mbps = self._bandwidth_mbps(src, dst)
        link = self._links.get((src, dst))
        if mbps is None:
            return None
        if link is None:
            link = self._links[(src, dst)] = Link(asyncio.get_running_loop(), src, dst, float(mbps))
        elif link.mbps != mbps:
            link.set_rate(float(mbps))
        return link

    def _delay_s(self, peer_ip: str, node: str) -> float | None:
        src = self._node_of_ip.get(peer_ip)
        if src is None:
            self._unknown_source += 1
            if peer_ip not in self._unknown_ips:
                self._unknown_ips.add(peer_ip)
                logger.debug("WAN: peer %s maps to no node; relaying without delay", peer_ip)
            return 0.0
        try:
            rtt = float(self._rtt_ms(src, node))
            if not math.isfinite(rtt) or rtt < 0:
                raise ValueError(f"rtt {rtt!r} ms is not a non-negative number")
        except Exception:
            # A bad rtt callable must not take the emulator down; refuse this connection.
            logger.exception("WAN: no RTT for %s -> %s; refusing the connection", src, node)
            return None
        return rtt / 2000.0

    async def _connect(self, conn: _Connection, peer_ip: str) -> None:
        loop = asyncio.get_running_loop()
        host, port = conn.route.backend
        local: tuple[str, int] | None = None
        if self._preserve_source_ip and peer_ip:
            local = (peer_ip, 0)
        try:
            try:
                await loop.create_connection(
                    lambda: _BackendProtocol(conn), host, port, local_addr=local
                )
            except OSError:
                if local is None:
                    raise
                # e.g. an IPv6 client in front of an IPv4 backend: connect from any address.
                await loop.create_connection(lambda: _BackendProtocol(conn), host, port)
        except OSError as exc:
            if self._stopping:  # counted, not logged: the backends are being stopped
                conn.route.connect_errors += 1
            else:
                _unreachable(conn.route, exc)
            conn.connect_failed()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("WAN task %s crashed", task.get_name(), exc_info=task.exception())

    def stats(self) -> WanStats:
        """Counters: connections (total, active, unknown source) and bytes per route."""
        return WanStats(
            connections=self._total,
            active=len(self.connections),
            unknown_source=self._unknown_source,
            routes={
                _hostport(r.front): RouteStats(
                    node=r.node,
                    backend=_hostport(r.backend),
                    connections=r.connections,
                    active=r.active,
                    bytes_to_backend=r.bytes_to_backend,
                    bytes_to_client=r.bytes_to_client,
                    connect_errors=r.connect_errors,
                )
                for r in self._routes
            },
            links={
                f"{link.src}->{link.dst}": LinkStats(
                    src=link.src,
                    dst=link.dst,
                    mbps=link.mbps,
                    bytes=link.bytes,
                    busy_s=round(link.busy_s, 6),
                )
                for link in self._links.values()
            },
        )

    def stopping(self) -> None:
        """The processes behind the routes are being stopped (`cpn up` on Ctrl-C): a backend
        that no longer answers is expected, and counted without a warning. Relaying goes on
        until `close`."""
        self._stopping = True

    async def close(self) -> None:
        """Stop listening, drop every relayed connection, and wait for all of it to end."""
        self._closed = True
        for route in self._routes:
            if route.server is not None:
                route.server.close()
        for conn in list(self.connections):
            conn.abort(graceful=False)
        for link in self._links.values():
            link.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for route in self._routes:
            if route.server is not None:
                await route.server.wait_closed()
        # Transports report connection_lost on the next loop iterations.
        for _ in range(100):
            if not self.connections:
                break
            await asyncio.sleep(0)
        self.connections.clear()


__all__ = [
    "DEFAULT_MAX_QUEUED_BYTES",
    "LinkStats",
    "PreciseEventLoop",
    "RouteStats",
    "WanEmulator",
    "WanStats",
    "new_event_loop",
    "run",
]
