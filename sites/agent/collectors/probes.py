"""Network probes from this site to every peer: RTT, jitter and loss; and achievable throughput.

Methods:
  http         GET /probe over one persistent TCP connection, timed at the application. The
               only method that sees the user-space WAN emulation, so `cpn up` uses it there.
  tcp-connect  time of a TCP handshake to the peer's agent port; works unprivileged.
  icmp         ICMP echo on a raw socket (root or CAP_NET_RAW).
  tcp-syn      SYN -> SYN-ACK with scapy (root).
`auto` picks http when the WAN is emulated, else icmp when a raw ICMP socket can be made, else
tcp-connect. Each peer is sampled `samples` times per interval, spread evenly, within a budget of
MAX_PROBES_PER_S for all peers together: past it (a site with hundreds of peers) each peer is
sampled less often, its first sample at a random point of its period, so a federation of a
thousand sites costs each agent a bounded rate of probes instead of a thousand peers x samples
per interval (bench/JOURNAL.md, 2026-12-07, night: the demo's 13 agents beside 1,000 sites
probed 2,500 times a second each and took the host's two cores). A link's figures
are taken over the last `samples` samples, less the host overhead: the agent also probes its own
responder through the same path (a zero-distance round trip: both hosts' stacks, the process
wake-ups, a relay if any) and subtracts the minimum of that, as TWAMP subtracts the reflector's
turnaround. `rtt_ms` is then the minimum, the path's RTT (host
scheduling and queueing only ever add delay, so the minimum is the estimator that noise cannot
bias upward; the spread shows in `rtt_median_ms` and `jitter_ms`).

Bandwidth (`BandwidthProber`): a bounded bulk download, `GET /probe/bulk?bytes=N` from the
peer's probe responder on a fresh connection, one peer at a time: each peer at most every
`bandwidth_interval_s`, probes at least interval / peers apart (so spread over the interval)
and never closer than the probe's timeout (so a site with a thousand peers sends and answers at
most bytes / timeout on average). Throughput = the bytes after the first read / the time from
the first read to the last, so the RTT (request out, first byte back) is not counted. The
last figure is kept, with its time, and published until the peer is measured again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from sites.agent.collectors import icmp
from sites.model.spec import (
    BANDWIDTH_INTERVAL_S,
    BANDWIDTH_PROBE_BYTES,
    BANDWIDTH_PROBE_TIMEOUT_S,
    MAX_BANDWIDTH_PROBE_BYTES,
)
from sites.model.status import LinkStatus

log = logging.getLogger(__name__)

METHODS = ("auto", "http", "tcp-connect", "icmp", "tcp-syn")
MAX_PROBES_PER_S = 50.0
"""All peers' RTT probes together, a second, at most (module docstring)."""


def choose_method(method: str, *, emulated: bool) -> str:
    if method != "auto":
        return method
    if emulated:
        return "http"
    return "icmp" if icmp.available() else "tcp-connect"


@dataclass(frozen=True)
class Target:
    host: str
    port: int

    @classmethod
    def from_url(cls, url: str) -> Target:
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise ValueError(f"peer url {url!r} lacks host or port")
        return cls(parts.hostname, parts.port)


class _Peer:
    """Samples one peer until stopped; keeps the last `window` results (None = lost)."""

    def __init__(
        self, *, target: Target, method: str, window: int, timeout_s: float, source: str | None
    ) -> None:
        self.target = target
        self.method = method
        self.timeout_s = timeout_s
        self.source = source
        self.samples: deque[float | None] = deque(maxlen=window)
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._request = (
            f"GET /probe HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            "User-Agent: cpn-probe\r\n\r\n"
        ).encode()

    async def run(self, period_s: Callable[[], float], stagger: bool = False) -> None:
        """Sample every period_s() (read again each time: it grows with the peers); with
        `stagger`, the first sample at a random point of the first period."""
        try:
            if stagger:
                await asyncio.sleep(random.uniform(0.0, period_s()))
            while True:
                started = time.monotonic()
                self.samples.append(await self.sample())
                await asyncio.sleep(max(0.0, period_s() - (time.monotonic() - started)))
        finally:
            self._close()

    async def sample(self) -> float | None:
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
            # races with completion, and this runs in a loop that must stop when cancelled
            async with asyncio.timeout(self.timeout_s):
                return await self._sample()
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            log.debug("probe %s via %s failed: %r", self.target, self.method, exc)
            self._close()
            return None

    async def _sample(self) -> float | None:
        t = self.target
        local = (self.source, 0) if self.source else None
        if self.method == "http":
            if self._conn is None:
                self._conn = await asyncio.open_connection(t.host, t.port, local_addr=local)
            reader, writer = self._conn
            start = time.perf_counter()
            writer.write(self._request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            elapsed = time.perf_counter() - start
            if not head.startswith(b"HTTP/1.1 200"):
                raise ValueError(f"probe answered {head.splitlines()[0]!r}")
            return elapsed * 1000.0
        if self.method == "tcp-connect":
            start = time.perf_counter()
            _, writer = await asyncio.open_connection(t.host, t.port, local_addr=local)
            elapsed = time.perf_counter() - start
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return elapsed * 1000.0
        if self.method == "icmp":
            return await icmp.echo_rtt_ms(t.host, self.source)
        if self.method == "tcp-syn":
            return await asyncio.to_thread(icmp.tcp_syn_rtt_ms, t.host, t.port, self.timeout_s)
        raise ValueError(f"unknown probe method {self.method!r}")

    def _close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


def summarize(
    src: str,
    dst: str,
    samples: list[float | None],
    *,
    method: str,
    emulated: bool,
    now: float,
    host_overhead_ms: float = 0.0,
    bandwidth: Bandwidth | None = None,
) -> LinkStatus:
    ok = [max(0.0, s - host_overhead_ms) for s in samples if s is not None]
    jitter = (
        statistics.fmean(abs(b - a) for a, b in zip(ok, ok[1:], strict=False))
        if len(ok) > 1
        else (0.0 if ok else None)
    )
    return LinkStatus(
        src=src,
        dst=dst,
        rtt_ms=round(min(ok), 3) if ok else None,
        rtt_median_ms=round(statistics.median(ok), 3) if ok else None,
        jitter_ms=None if jitter is None else round(jitter, 3),
        loss_pct=round(100.0 * (len(samples) - len(ok)) / len(samples), 1) if samples else 0.0,
        samples=len(samples),
        method=method,
        emulated=emulated,
        host_overhead_ms=round(host_overhead_ms, 3),
        bandwidth_mbps=None if bandwidth is None else bandwidth.mbps,
        bandwidth_at=None if bandwidth is None else bandwidth.at,
        measured_at=now,
    )


PROBE_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
BULK_PATH = b"/probe/bulk"
_BULK_BLOCK = memoryview(bytes(256 * 1024))  # the body: zeros, written a block at a time


def _bulk_bytes(head: bytes) -> int | None:
    """N of a `GET /probe/bulk?bytes=N` request head, capped; None for any other request."""
    line = head.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2 or not parts[1].startswith(BULK_PATH):
        return None
    _, _, query = parts[1].partition(b"?")
    n = BANDWIDTH_PROBE_BYTES
    for pair in query.split(b"&"):
        key, _, value = pair.partition(b"=")
        if key == b"bytes" and value.isdigit():
            n = int(value)
    return max(0, min(n, MAX_BANDWIDTH_PROBE_BYTES))


class ProbeResponder(asyncio.Protocol):
    """The probe target: answers every HTTP request on the connection with `200 ok`, and
    `GET /probe/bulk?bytes=N` with N zero bytes (at most MAX_BANDWIDTH_PROBE_BYTES).

    It runs on its own port beside the agent's aiohttp app (which also serves /probe for people)
    so that a probe times the network and not the web framework: on a 2-core VM aiohttp adds
    ~0.3 ms per request, 5 % of a 5 ms link; this answers in a few microseconds of Python.
    A bulk body is written a block at a time while the transport accepts it (pause_writing),
    so a slow path holds it back instead of the responder buffering it; requests pipelined
    behind it are answered after it.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._bulk_left = 0  # bytes of a bulk body still to write
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not isinstance: uvloop's transports do not subclass asyncio.Transport
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > 65536:  # not a probe client; drop it
            if self._transport is not None:
                self._transport.close()
            return
        self._answer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._answer()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self._bulk_left:
            log.debug("bulk probe client left with %d bytes unsent: %s", self._bulk_left, exc)
        self._transport = None
        self._bulk_left = 0

    def _answer(self) -> None:
        transport = self._transport
        while transport is not None and not transport.is_closing():
            if self._bulk_left:
                if self._paused:
                    return
                n = min(self._bulk_left, len(_BULK_BLOCK))
                self._bulk_left -= n
                transport.write(_BULK_BLOCK[:n])
                continue
            if b"\r\n\r\n" not in self._buffer:
                return
            head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
            bulk = _bulk_bytes(head)
            if bulk is None:
                transport.write(PROBE_RESPONSE)
                continue
            transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: %d\r\n\r\n" % bulk
            )
            self._bulk_left = bulk


@dataclass(frozen=True)
class Bandwidth:
    """A peer's achievable throughput (Mbit/s, data from the peer to us), measured at `at`."""

    mbps: float
    at: float


async def measure_bandwidth(
    target: Target, *, nbytes: int, timeout_s: float, source: str | None
) -> float:
    """Mbit/s of a `GET /probe/bulk?bytes=nbytes` from `target`, counted from the first read.

    Raises TimeoutError, OSError, asyncio.IncompleteReadError or ValueError (a bad answer)."""
    local = (source, 0) if source else None
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(target.host, target.port, local_addr=local)
        try:
            writer.write(
                f"GET /probe/bulk?bytes={nbytes} HTTP/1.1\r\nHost: {target.host}:{target.port}"
                "\r\nUser-Agent: cpn-probe\r\n\r\n".encode()
            )
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await reader.read(65536)
                if not chunk:
                    raise asyncio.IncompleteReadError(head, None)
                head += chunk
            first_at = time.perf_counter()
            head, _, body = head.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise ValueError(f"bulk probe answered {head.splitlines()[0]!r}")
            length = _content_length(head)
            if length != nbytes:
                raise ValueError(f"bulk probe sent {length} bytes, asked for {nbytes}")
            got = len(body)
            after_first = 0
            last_at = first_at
            while got < length:
                chunk = await reader.read(min(1 << 20, length - got))
                if not chunk:
                    raise asyncio.IncompleteReadError(b"", length - got)
                got += len(chunk)
                after_first += len(chunk)
                last_at = time.perf_counter()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    elapsed = last_at - first_at
    if after_first == 0 or elapsed <= 0:
        raise ValueError(f"bulk probe of {nbytes} bytes arrived in one read: too small to time")
    return after_first * 8 / elapsed / 1e6


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    raise ValueError("bulk probe answer has no Content-Length")


class BandwidthProber:
    """Measures each peer's throughput, one peer at a time, each at most every `interval_s`
    (module docstring); keeps the last figure per peer."""

    def __init__(
        self,
        *,
        interval_s: float,
        nbytes: int,
        timeout_s: float,
        source: str | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"bandwidth interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.nbytes = max(1, min(nbytes, MAX_BANDWIDTH_PROBE_BYTES))
        self.timeout_s = timeout_s
        self.source = source
        self._clock = clock
        self.targets: dict[str, Target] = {}
        self.results: dict[str, Bandwidth] = {}
        self._tried: dict[str, float] = {}  # site -> loop time of its last probe (ok or not)
        self.probes = 0  # probes started, for tests and /healthz

    def set_targets(self, targets: Mapping[str, Target]) -> None:
        for site in list(self.targets):
            if targets.get(site) != self.targets[site]:
                del self.targets[site]
                self.results.pop(site, None)
                self._tried.pop(site, None)
        self.targets.update(targets)

    def spacing_s(self) -> float:
        """Time between two probes: the interval spread over the peers, never below the
        timeout (so probes never overlap and a large federation stays bounded)."""
        return max(self.interval_s / max(1, len(self.targets)), self.timeout_s)

    def due(self, now: float) -> str | None:
        """The peer to probe next: never probed first, else the longest ago; None if every
        peer was probed within the interval."""
        best: tuple[float, str] | None = None
        for site in sorted(self.targets):
            last = self._tried.get(site)
            if last is not None and now - last < self.interval_s:
                continue
            key = (-math.inf if last is None else last, site)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]

    async def probe(self, site: str) -> Bandwidth | None:
        target = self.targets[site]
        self._tried[site] = asyncio.get_running_loop().time()
        self.probes += 1
        try:
            mbps = await measure_bandwidth(
                target, nbytes=self.nbytes, timeout_s=self.timeout_s, source=self.source
            )
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            # the last figure stays: a failed probe says nothing about the path's bandwidth
            log.debug("bandwidth probe of %s (%s) failed: %r", site, target, exc)
            return None
        result = Bandwidth(mbps=round(mbps, 3), at=self._clock())
        if self.targets.get(site) == target:  # not dropped or moved while we measured
            self.results[site] = result
        return result

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            site = self.due(loop.time())
            if site is None:
                # nothing due: look again soon (a new peer), at no cost
                await asyncio.sleep(min(self.spacing_s(), 1.0))
                continue
            started = loop.time()
            await self.probe(site)
            await asyncio.sleep(max(0.0, self.spacing_s() - (loop.time() - started)))


class Prober:
    """Keeps one sampling task per peer; `set_peers` adds and drops peers as they come and go."""

    def __init__(
        self,
        *,
        site: str,
        method: str,
        samples: int,
        interval_s: float,
        timeout_s: float,
        source: str | None,
        emulated: bool,
        bandwidth_interval_s: float = BANDWIDTH_INTERVAL_S,
        bandwidth_probe_bytes: int = BANDWIDTH_PROBE_BYTES,
        bandwidth_probe_timeout_s: float = BANDWIDTH_PROBE_TIMEOUT_S,
        max_probes_per_s: float = MAX_PROBES_PER_S,
    ) -> None:
        self.site = site
        self.max_probes_per_s = max_probes_per_s
        self.method = method
        self.samples = samples
        self.interval_s = interval_s
        self.timeout_s = min(timeout_s, interval_s)
        self.source = source
        self.emulated = emulated
        self._peers: dict[str, tuple[_Peer, asyncio.Task[None]]] = {}
        self._self: tuple[_Peer, asyncio.Task[None]] | None = None
        # the peers' throughput (None: bandwidth_interval_s 0, not measured); its task starts
        # with the first peers
        self.bandwidth: BandwidthProber | None = None
        if bandwidth_interval_s > 0:
            self.bandwidth = BandwidthProber(
                interval_s=bandwidth_interval_s,
                nbytes=bandwidth_probe_bytes,
                timeout_s=bandwidth_probe_timeout_s,
                source=source,
            )
        self._bandwidth_task: asyncio.Task[None] | None = None

    def set_self(self, url: str) -> None:
        """Probe our own responder at `url` to learn the host overhead of a round trip."""
        if self._self is not None:
            self._self[1].cancel()
        peer = _Peer(
            target=Target.from_url(url),
            method=self.method,
            window=4 * self.samples,
            timeout_s=self.timeout_s,
            source=self.source,
        )
        every = self.interval_s / self.samples
        task = asyncio.create_task(peer.run(lambda: every), name=f"probe {self.site}->self")
        task.add_done_callback(_log_crash)
        self._self = (peer, task)

    def period_s(self) -> float:
        """How often each peer is sampled: `samples` times an interval, or less often when
        that would pass MAX_PROBES_PER_S for all the peers."""
        return max(self.interval_s / self.samples, len(self._peers) / self.max_probes_per_s)

    def host_overhead_ms(self) -> float:
        if self._self is None:
            return 0.0
        ok = [s for s in self._self[0].samples if s is not None]
        return min(ok) if ok else 0.0

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """peers: site id -> agent URL."""
        for site in list(self._peers):
            peer, _ = self._peers[site]
            if site not in peers or Target.from_url(peers[site]) != peer.target:
                self._drop(site)
        # past the budget the new peers' first samples are spread over their period
        stagger = len(peers) / self.max_probes_per_s > self.interval_s / self.samples
        for site, url in peers.items():
            if site == self.site or site in self._peers:
                continue
            try:
                target = Target.from_url(url)
            except ValueError as exc:
                log.warning("peer %s: %s", site, exc)
                continue
            peer = _Peer(
                target=target,
                method=self.method,
                window=self.samples,
                timeout_s=self.timeout_s,
                source=self.source,
            )
            task = asyncio.create_task(
                peer.run(self.period_s, stagger=stagger),
                name=f"probe {self.site}->{site}",
            )
            task.add_done_callback(_log_crash)
            self._peers[site] = (peer, task)
        if self.bandwidth is not None:
            self.bandwidth.set_targets(
                {site: peer.target for site, (peer, _) in self._peers.items()}
            )
            if self._bandwidth_task is None and self._peers:
                self._bandwidth_task = asyncio.create_task(
                    self.bandwidth.run(), name=f"bandwidth probes {self.site}"
                )
                self._bandwidth_task.add_done_callback(_log_crash)

    def _drop(self, site: str) -> None:
        _, task = self._peers.pop(site)
        task.cancel()

    def links(self, now: float) -> list[LinkStatus]:
        overhead = self.host_overhead_ms()
        measured = self.bandwidth.results if self.bandwidth is not None else {}
        return [
            summarize(
                self.site,
                dst,
                list(peer.samples),
                method=self.method,
                emulated=self.emulated,
                now=now,
                host_overhead_ms=overhead,
                bandwidth=measured.get(dst),
            )
            for dst, (peer, _) in sorted(self._peers.items())
            if peer.samples
        ]

    async def close(self) -> None:
        tasks = [task for _, task in self._peers.values()]
        if self._bandwidth_task is not None:
            tasks.append(self._bandwidth_task)
            self._bandwidth_task = None
        if self._self is not None:
            tasks.append(self._self[1])
            self._self = None
        self._peers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed", task.get_name(), exc_info=task.exception())
