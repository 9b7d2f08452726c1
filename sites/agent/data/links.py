"""Per-link bandwidth limits and what a transfer reports of its progress.

`LinkLimits` holds one token bucket per source site, shared by every transfer pulling from
it, so the link's limit holds however many files or stagings use it at once. `Meter` turns
bytes moved into the recent rate and an ETA, and says when a progress report is due (at most
`every_s`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from sites.kits.clock import Clock

BURST_S = 0.1  # a bucket holds this many seconds of its rate (at least one chunk)
MIN_BURST = 64 * 1024


def mbps_to_bps(mbps: float) -> float:
    """Mbit/s -> bytes per second."""
    return mbps * 1_000_000 / 8


class TokenBucket:
    """`rate_bps` bytes per second on average; a request waits until its bytes are covered."""

    def __init__(self, rate_bps: float, *, clock: Clock) -> None:
        self.rate_bps = rate_bps
        self.burst = max(MIN_BURST, rate_bps * BURST_S)
        self.clock = clock
        self._tokens = self.burst
        self._at = clock.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:  # first come, first served: waiters queue on the lock
            now = self.clock.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_bps)
            self._at = now
            self._tokens -= n
            if self._tokens < 0:
                await self.clock.sleep(-self._tokens / self.rate_bps)


class LinkLimits:
    """The bucket of each source site: `per_site_mbps` over `default_mbps` (None: no limit)."""

    def __init__(
        self,
        *,
        default_mbps: float | None,
        per_site_mbps: Mapping[str, float] | None = None,
        clock: Clock,
    ) -> None:
        self.default_mbps = default_mbps
        self.per_site_mbps = dict(per_site_mbps or {})
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def bucket(self, site: str) -> TokenBucket | None:
        mbps = self.per_site_mbps.get(site, self.default_mbps)
        if mbps is None:
            return None
        bucket = self._buckets.get(site)
        if bucket is None:
            bucket = self._buckets[site] = TokenBucket(mbps_to_bps(mbps), clock=self.clock)
        return bucket


@dataclass
class Meter:
    """Bytes done of a total, the rate over the last `window_s`, and when to report."""

    total: int
    clock: Clock
    window_s: float = 3.0
    every_s: float = 0.25
    done: int = 0
    _samples: deque[tuple[float, int]] = field(default_factory=deque)
    _moved: int = 0  # bytes over the wire, for the rate
    _reported_at: float | None = None

    def add(self, n: int, *, wire: bool = True) -> None:
        self.done += n
        if wire and n > 0:
            self._moved += n
            now = self.clock.monotonic()
            self._samples.append((now, self._moved))
            while self._samples and now - self._samples[0][0] > self.window_s:
                self._samples.popleft()

    def rate_bps(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.rate_bps()
        left = max(0, self.total - self.done)
        if left == 0:
            return 0.0
        return left / rate if rate > 0 else None

    def due(self, *, force: bool = False) -> bool:
        now = self.clock.monotonic()
        if force or self._reported_at is None or now - self._reported_at >= self.every_s:
            self._reported_at = now
            return True
        return False
