"""Live load of the site's inference services, for the endpoints the agent publishes.

Each service is polled every interval:

1. `<url>/metrics`, the model server's Prometheus exposition, parsed with prometheus_client's
   text parser, so a real vLLM or SGLang drops in where the stand-in runs:

   in_flight       vllm:num_requests_running     sglang:num_running_reqs
   queue           vllm:num_requests_waiting     sglang:num_queue_reqs
   kv_cache_usage  vllm:gpu_cache_usage_perc     sglang:token_usage
                   (V1: vllm:kv_cache_usage_perc)
   ttft            vllm:time_to_first_token_seconds, sglang:time_to_first_token_seconds

   Gauges are summed over their label sets (one per model_name). The TTFT mean and p95 are of
   the observations since the previous scrape (the histogram's deltas; None when there were
   none). An exposition without the running or waiting gauge counts as no signals.
2. `<url>/stats` (in_flight, queue, p50_ms, as the stand-in and cpn-aware servers answer): the
   load when /metrics gave none, and the per-request latency (p50_ms) in any case.
3. Else `<url>/healthz`, else `<url>/`: a server that answers at all is healthy, load unknown.

A connection error, or no answer from /healthz in time, marks the endpoint unhealthy until it
answers again (a /metrics or /stats that times out only counts as no signals). A server
that answers but whose signals cannot be read this round keeps its last signals and their
time (`signals_at`), so routing sees them age and counts them as saturated once stale.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sites.model.spec import Service

log = logging.getLogger(__name__)

__all__ = ["Histogram", "ServiceLoad", "ServiceMonitor", "Signals", "parse_signals"]

MAX_METRICS_BYTES = 4 * 1024 * 1024  # a vLLM exposition is ~50 kB; refuse a runaway one

# signal -> the metric names that carry it, first found wins (vLLM V0 and V1, SGLang)
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "sglang:token_usage")
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: (upper bound s, cumulative count) ascending, +Inf last."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def since(self, before: Histogram | None) -> Histogram:
        """The observations made after `before` (a counter reset: all of them)."""
        if (
            before is None
            or before.count > self.count
            or [b for b, _ in before.buckets] != [b for b, _ in self.buckets]
        ):
            return self
        return Histogram(
            tuple(
                (bound, n - m)
                for (bound, n), (_, m) in zip(self.buckets, before.buckets, strict=True)
            ),
            self.count - before.count,
            self.sum - before.sum,
        )

    def mean_ms(self) -> float | None:
        return self.sum / self.count * 1000 if self.count > 0 else None

    def quantile_ms(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding the q-th observation, as PromQL's
        histogram_quantile does; the highest finite bound when it falls in +Inf."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cum in self.buckets:
            if cum >= rank:
                if math.isinf(bound):
                    return lower * 1000
                inside = cum - below
                frac = (rank - below) / inside if inside > 0 else 1.0
                return (lower + (bound - lower) * frac) * 1000
            lower, below = bound, cum
        return lower * 1000


@dataclass(frozen=True)
class Signals:
    """What one /metrics scrape says about the server."""

    source: str  # vllm | sglang
    running: int
    waiting: int
    kv_cache_usage: float | None
    ttft: Histogram | None


def parse_signals(text: str) -> Signals | None:
    """The signals in a Prometheus text exposition; None when it has no running and waiting
    gauges of a known server. ValueError when the text is not an exposition."""
    gauges: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name in TTFT and family.type == "histogram":
            histograms[family.name] = _histogram(family.samples)
        elif family.name in RUNNING or family.name in WAITING or family.name in KV_USAGE:
            gauges[family.name] = sum(s.value for s in family.samples if math.isfinite(s.value))
    running = _first(gauges, RUNNING)
    waiting = _first(gauges, WAITING)
    if running is None or waiting is None:
        return None
    source = next(n for n in (*RUNNING, *WAITING) if n in gauges).split(":", 1)[0]
    kv = _first(gauges, KV_USAGE)
    ttft = next((histograms[n] for n in TTFT if n in histograms), None)
    return Signals(
        source=source,
        running=max(0, round(running)),
        waiting=max(0, round(waiting)),
        kv_cache_usage=None if kv is None else min(1.0, max(0.0, kv)),
        ttft=ttft,
    )


def _first(values: Mapping[str, float], names: Iterable[str]) -> float | None:
    return next((values[n] for n in names if n in values), None)


def _histogram(samples: Iterable[Any]) -> Histogram:
    # bucket counts summed over the label sets other than le (one per model_name)
    buckets: dict[float, float] = {}
    count = total = 0.0
    for s in samples:
        if s.name.endswith("_bucket"):
            bound = float(s.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + s.value
        elif s.name.endswith("_count"):
            count += s.value
        elif s.name.endswith("_sum"):
            total += s.value
    return Histogram(tuple(sorted(buckets.items())), count, total)


@dataclass(frozen=True)
class ServiceLoad:
    healthy: bool
    in_flight: int = 0
    queue: int = 0
    latency_ms: float | None = None
    kv_cache_usage: float | None = None
    ttft_ms: float | None = None
    ttft_p95_ms: float | None = None
    signals: str | None = None  # vllm | sglang | stats; None: no load report
    signals_at: float | None = None  # unix s of the read they came from

    def signal_fields(self) -> dict[str, Any]:
        """The model-server signals as sites.model.status.ServiceEndpoint's fields."""
        return {
            "kv_cache_usage": self.kv_cache_usage,
            "ttft_ms": self.ttft_ms,
            "ttft_p95_ms": self.ttft_p95_ms,
            "signals": self.signals,
            "signals_at": self.signals_at,
        }


class ServiceMonitor:
    def __init__(
        self,
        services: tuple[Service, ...],
        *,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        by_url: bool = False,
    ) -> None:
        self.services = services
        self.timeout_s = timeout_s
        self.clock = clock  # unix s, for signals_at
        # loads by service name, or by URL (by_url: several replicas of one service at a site)
        self._key: Callable[[Service], str] = _url if by_url else _name
        self.loads: dict[str, ServiceLoad] = {}
        self._ttft: dict[str, Histogram] = {}  # the last scrape's histogram, per key
        self._session: aiohttp.ClientSession | None = None

    async def poll(self) -> None:
        if not self.services:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        session = self._session
        results = await asyncio.gather(*(self._poll(session, svc) for svc in self.services))
        key = self._key
        self.loads = {key(svc): load for svc, load in zip(self.services, results, strict=True)}

    async def _poll(self, session: aiohttp.ClientSession, svc: Service) -> ServiceLoad:
        base = svc.url.rstrip("/")
        key = self._key(svc)
        try:
            now = self.clock()
            signals = await self._scrape(session, base, svc.name)
            stats = await self._stats(session, base)
            if signals is not None:
                ttft = None
                if signals.ttft is not None:
                    ttft = signals.ttft.since(self._ttft.get(key))
                    self._ttft[key] = signals.ttft
                return ServiceLoad(
                    healthy=True,
                    in_flight=signals.running,
                    queue=signals.waiting,
                    latency_ms=None if stats is None else _float(stats.get("p50_ms")),
                    kv_cache_usage=signals.kv_cache_usage,
                    ttft_ms=None if ttft is None else _round(ttft.mean_ms()),
                    ttft_p95_ms=None if ttft is None else _round(ttft.quantile_ms(0.95)),
                    signals=signals.source,
                    signals_at=now,
                )
            if stats is not None:
                return ServiceLoad(
                    healthy=True,
                    in_flight=int(stats.get("in_flight", 0)),
                    queue=int(stats.get("queue", 0)),
                    latency_ms=_float(stats.get("p50_ms")),
                    signals="stats",
                    signals_at=now,
                )
            for path in ("/healthz", "/"):
                async with session.get(base + path) as resp:
                    if resp.status < 500:
                        return self._unread(key, healthy=resp.status < 400 or path == "/")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("service %s at %s: %r", svc.name, svc.url, exc)
        return ServiceLoad(healthy=False)

    def _unread(self, service: str, *, healthy: bool) -> ServiceLoad:
        """A server that answers without signals this round: its last ones, at their old time."""
        last = self.loads.get(service)
        if last is None or last.signals is None:
            return ServiceLoad(healthy=healthy)
        return replace(last, healthy=healthy, ttft_ms=None, ttft_p95_ms=None)

    async def _scrape(
        self, session: aiohttp.ClientSession, base: str, service: str
    ) -> Signals | None:
        try:
            async with session.get(base + "/metrics") as resp:
                if resp.status != 200:
                    return None
                raw = await resp.content.read(MAX_METRICS_BYTES + 1)
            if len(raw) > MAX_METRICS_BYTES:
                log.warning("service %s: /metrics over %d bytes", service, MAX_METRICS_BYTES)
                return None
            return parse_signals(raw.decode("utf-8", errors="replace"))
        except ValueError as exc:  # not an exposition: fall back to /stats
            log.debug("service %s: /metrics does not parse: %s", service, exc)
            return None
        except TimeoutError:  # an overloaded server may answer /stats or /healthz still
            log.debug("service %s: /metrics timed out", service)
            return None

    async def _stats(self, session: aiohttp.ClientSession, base: str) -> dict[str, Any] | None:
        try:
            async with session.get(base + "/stats") as resp:
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
        except (ValueError, TimeoutError):
            return None
        return data if isinstance(data, dict) else None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _name(svc: Service) -> str:
    return svc.name


def _url(svc: Service) -> str:
    return svc.url


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
