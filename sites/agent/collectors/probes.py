"""Network probes from this site to every peer: RTT, jitter and loss.

Methods:
  http         GET /probe over one persistent TCP connection, timed at the application. The
               only method that sees the user-space WAN emulation, so `cpn up` uses it there.
  tcp-connect  time of a TCP handshake to the peer's agent port; works unprivileged.
  icmp         ICMP echo on a raw socket (root or CAP_NET_RAW).
  tcp-syn      SYN -> SYN-ACK with scapy (root).
`auto` picks http when the WAN is emulated, else icmp when a raw ICMP socket can be made, else
tcp-connect. Each peer is sampled `samples` times per interval, spread evenly; a link's figures
are taken over the last `samples` samples, less the host overhead: the agent also probes its own
responder through the same path (a zero-distance round trip: both hosts' stacks, the process
wake-ups, a relay if any) and subtracts the minimum of that, as TWAMP subtracts the reflector's
turnaround. `rtt_ms` is then the minimum, the path's RTT (host
scheduling and queueing only ever add delay, so the minimum is the estimator that noise cannot
bias upward; the spread shows in `rtt_median_ms` and `jitter_ms`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from sites.agent.collectors import icmp
from sites.model.status import LinkStatus

log = logging.getLogger(__name__)

METHODS = ("auto", "http", "tcp-connect", "icmp", "tcp-syn")


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

    async def run(self, period_s: float) -> None:
        try:
            while True:
                started = time.monotonic()
                self.samples.append(await self.sample())
                await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))
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
        measured_at=now,
    )


PROBE_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


class ProbeResponder(asyncio.Protocol):
    """The probe target: answers every HTTP request on the connection with `200 ok`.

    It runs on its own port beside the agent's aiohttp app (which also serves /probe for people)
    so that a probe times the network and not the web framework: on a 2-core VM aiohttp adds
    ~0.3 ms per request, 5 % of a 5 ms link; this answers in a few microseconds of Python.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not isinstance: uvloop's transports do not subclass asyncio.Transport
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > 65536:  # not a probe client; drop it
            if self._transport is not None:
                self._transport.close()
            return
        while b"\r\n\r\n" in self._buffer:
            _, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
            if self._transport is not None:
                self._transport.write(PROBE_RESPONSE)


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
    ) -> None:
        self.site = site
        self.method = method
        self.samples = samples
        self.interval_s = interval_s
        self.timeout_s = min(timeout_s, interval_s)
        self.source = source
        self.emulated = emulated
        self._peers: dict[str, tuple[_Peer, asyncio.Task[None]]] = {}
        self._self: tuple[_Peer, asyncio.Task[None]] | None = None

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
        task = asyncio.create_task(
            peer.run(self.interval_s / self.samples), name=f"probe {self.site}->self"
        )
        task.add_done_callback(_log_crash)
        self._self = (peer, task)

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
                peer.run(self.interval_s / self.samples), name=f"probe {self.site}->{site}"
            )
            task.add_done_callback(_log_crash)
            self._peers[site] = (peer, task)

    def _drop(self, site: str) -> None:
        _, task = self._peers.pop(site)
        task.cancel()

    def links(self, now: float) -> list[LinkStatus]:
        overhead = self.host_overhead_ms()
        return [
            summarize(
                self.site,
                dst,
                list(peer.samples),
                method=self.method,
                emulated=self.emulated,
                now=now,
                host_overhead_ms=overhead,
            )
            for dst, (peer, _) in sorted(self._peers.items())
            if peer.samples
        ]

    async def close(self) -> None:
        tasks = [task for _, task in self._peers.values()]
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
