"""What the gateway sees of each managed service's demand, for the leader's autoscaler.

Every broker replica's gateway (routing.gateway.proxy) counts, per (service, client region), the
requests it took and their time to first byte (the first byte of the answer to the client: the
first token of a stream, RTT included) in a fixed-bucket histogram: `TrafficBook`, a few ints per
pair, nothing allocated per request. The counts are cumulative since the replica started, like
Prometheus counters; `TrafficPublisher` writes them every `publish_s` to
/cpn/v1/traffic/<instance> under a lease of the replica's own (`TrafficSummary`), so a replica
that dies takes its key with it.

The leader turns them into rates the way Prometheus' rate() does: per replica, the counts now
minus the counts at the service's previous decision (`Baseline`), over the time between the
two summaries; summed over replicas (`client_observations`). A replica that appeared since the
previous decision counts from zero (its `started_at`); a new leader has no baseline yet, so its
first interval for a service only takes one. The p95 comes from the merged histogram
(linear within a bucket).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from broker.model.autoscaler import ClientObservation
from broker.model.jobs import Frozen
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import RegistryError
from sites.registry.client import Registry

__all__ = [
    "TTFB_BUCKETS_MS",
    "Baseline",
    "PairCounts",
    "TrafficBook",
    "TrafficPublisher",
    "TrafficSummary",
    "client_observations",
    "p95_ms",
]

log = logging.getLogger(__name__)

# upper bounds, ms; one more bucket beyond the last. SLOs are hundreds of ms to seconds.
TTFB_BUCKETS_MS: tuple[float, ...] = (
    10, 25, 50, 100, 150, 200, 300, 400, 500, 600, 800, 1_000, 1_500, 2_000, 3_000, 5_000,
    10_000, 30_000,
)  # fmt: skip
# pairs a replica tracks at most: services x client regions are both checked before a request
# is counted, this only bounds the memory against a misconfiguration
MAX_PAIRS = 10_000
PUBLISH_S = 1.0


class PairCounts(Frozen):
    """One (service, client region): requests taken and first bytes per TTFB bucket, since the
    replica started."""

    requests: int = Field(default=0, ge=0)
    ttfb: tuple[int, ...] = Field(
        default=(), description="answers per TTFB_BUCKETS_MS bucket, the last one beyond them"
    )


class TrafficSummary(Frozen):
    """/cpn/v1/traffic/<instance>: one replica's cumulative counts (module docstring)."""

    instance: str
    started_at: float = Field(description="unix s the counts start from")
    at: float = Field(description="unix s of these counts")
    services: dict[str, dict[str, PairCounts]] = Field(
        default_factory=dict, description="service -> client region -> counts"
    )


class TrafficBook:
    """The gateway's counters (routing.gateway.proxy.TrafficSink): O(1) per request."""

    def __init__(self) -> None:
        # (service, region) -> [requests, bucket 0, ..., bucket n]
        self._pairs: dict[tuple[str, str], list[int]] = {}

    def _row(self, service: str, region: str) -> list[int] | None:
        row = self._pairs.get((service, region))
        if row is None:
            if len(self._pairs) >= MAX_PAIRS:
                return None
            row = self._pairs[(service, region)] = [0] * (len(TTFB_BUCKETS_MS) + 2)
        return row

    def request(self, service: str, region: str) -> None:
        row = self._row(service, region)
        if row is not None:
            row[0] += 1

    def first_byte(self, service: str, region: str, seconds: float) -> None:
        row = self._row(service, region)
        if row is not None:
            row[1 + bisect.bisect_left(TTFB_BUCKETS_MS, seconds * 1000.0)] += 1

    def summary(self, instance: str, started_at: float, at: float) -> TrafficSummary:
        services: dict[str, dict[str, PairCounts]] = {}
        for (service, region), row in list(self._pairs.items()):
            services.setdefault(service, {})[region] = PairCounts(
                requests=row[0], ttfb=tuple(row[1:])
            )
        return TrafficSummary(instance=instance, started_at=started_at, at=at, services=services)


class TrafficPublisher:
    """Writes the book's summary every `publish_s` under a lease of its own (any replica)."""

    def __init__(
        self,
        *,
        registry: Registry,
        book: TrafficBook,
        instance: str,
        clock: Clock,
        publish_s: float = PUBLISH_S,
    ) -> None:
        self.registry = registry
        self.book = book
        self.instance = instance
        self.clock = clock
        self.publish_s = publish_s
        self.started_at = clock.time()
        self._lease: int | None = None

    async def run(self) -> None:
        ttl = max(3, math.ceil(3 * self.publish_s))
        try:
            while True:
                try:
                    await self.publish_once(ttl)
                except RegistryError as exc:
                    log.warning("traffic summary not published: %s", exc)
                    self._lease = None  # a lost lease or etcd away: a new one next time
                await self.clock.sleep(self.publish_s)
        finally:
            lease, self._lease = self._lease, None
            if lease is not None:
                try:
                    await asyncio.shield(self.registry.revoke(lease))
                except RegistryError as exc:
                    log.warning("traffic lease not revoked (it expires): %s", exc)

    async def publish_once(self, ttl_s: int = 3) -> None:
        if self._lease is None:
            self._lease = await self.registry.grant_lease(ttl_s)
        else:
            await self.registry.keepalive(self._lease)
        summary = self.book.summary(self.instance, self.started_at, self.clock.time())
        await self.registry.commit(
            guards=[],
            puts={keys.traffic(self.instance): summary.model_dump_json().encode()},
            lease_id=self._lease,
        )


# -- the leader's side: pure -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Baseline:
    """A service's counts per replica at its previous decision: instance -> (at, counts)."""

    at: float
    counts: Mapping[str, tuple[float, Mapping[str, PairCounts]]]


def _minus(now: PairCounts, before: PairCounts | None) -> tuple[int, list[int]]:
    width = len(TTFB_BUCKETS_MS) + 1
    got = list(now.ttfb[:width]) + [0] * max(0, width - len(now.ttfb))
    if before is None:
        return now.requests, got
    old = list(before.ttfb[:width]) + [0] * max(0, width - len(before.ttfb))
    if now.requests < before.requests or any(a < b for a, b in zip(got, old, strict=True)):
        return now.requests, got  # counts went back: a restart under the same name
    return now.requests - before.requests, [a - b for a, b in zip(got, old, strict=True)]


def p95_ms(buckets: list[int], quantile: float = 0.95) -> float | None:
    """The quantile of a TTFB_BUCKETS_MS histogram, linear within its bucket (the last bucket,
    unbounded, answers its lower bound); None when it is empty."""
    total = sum(buckets)
    if total <= 0:
        return None
    rank = quantile * total
    seen = 0
    for index, count in enumerate(buckets):
        if count > 0 and seen + count >= rank:
            if index >= len(TTFB_BUCKETS_MS):
                return TTFB_BUCKETS_MS[-1]
            low = TTFB_BUCKETS_MS[index - 1] if index > 0 else 0.0
            high = TTFB_BUCKETS_MS[index]
            return low + (high - low) * (rank - seen) / count
        seen += count
    return TTFB_BUCKETS_MS[-1]


def client_observations(
    service: str,
    summaries: Mapping[str, TrafficSummary],
    baseline: Baseline | None,
    now: float,
    *,
    max_age_s: float,
) -> tuple[dict[str, ClientObservation], Baseline]:
    """Per client region, the request rate and p95 TTFB every replica's gateway saw for
    `service` since `baseline` (module docstring), and the baseline for the next decision.
    Summaries older than `max_age_s` are left out (a replica stuck or cut off from etcd)."""
    counts: dict[str, tuple[float, Mapping[str, PairCounts]]] = {}
    rates: dict[str, float] = {}
    hists: dict[str, list[int]] = {}
    for instance, summary in summaries.items():
        if now - summary.at > max_age_s:
            continue
        mine = summary.services.get(service, {})
        counts[instance] = (summary.at, mine)
        if baseline is None:
            continue
        before = baseline.counts.get(instance)
        if before is not None:
            since, old = before
        elif summary.started_at >= baseline.at:
            since, old = summary.started_at, {}  # a replica that started since: from zero
        else:
            continue  # present before but unseen then (its summary was late): next time
        span = summary.at - since
        if span <= 0:
            continue
        for region, pair in mine.items():
            requests, buckets = _minus(pair, old.get(region))
            rates[region] = rates.get(region, 0.0) + requests / span
            into = hists.setdefault(region, [0] * (len(TTFB_BUCKETS_MS) + 1))
            for index, count in enumerate(buckets):
                into[index] += count
    out = {
        region: ClientObservation(rate_per_s=rate, ttft_p95_ms=p95_ms(hists.get(region, [])))
        for region, rate in rates.items()
    }
    return out, Baseline(at=now, counts=counts)
