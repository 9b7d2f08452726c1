"""Live load of the site's inference services, for the endpoints the agent publishes.

Each service is polled every interval:

1. `<url>/metrics`, the model server's Prometheus exposition, parsed with prometheus_client's
   text parser, so a real vLLM or SGLang drops in where the stand-in runs:

   in_flight       vllm:num_requests_running     sglang:num_running_reqs
   queue           vllm:num_requests_waiting     sglang:num_queue_reqs
   kv_cache_usage  vllm:kv_cache_usage_perc      sglang:token_usage
                   (deprecated: vllm:gpu_cache_usage_perc)
   ttft            vllm:time_to_first_token_seconds, sglang:time_to_first_token_seconds
   prefix cache    vllm:prefix_cache_queries, vllm:prefix_cache_hits (counters, tokens;
                   deprecated: vllm:gpu_prefix_cache_*)          sglang:cache_hit_rate
   adapters        vllm:lora_requests_info's running_lora_adapters and
                   waiting_lora_adapters labels (comma-separated; the newest sample)

   Gauges are summed over their label sets (one per model_name and engine). The TTFT mean and
   p95 are of the observations since the previous scrape (the histogram's deltas; None when
   there were none), and so is the prefix-cache hit rate (hits / queries since then; None when
   there were no queries). An exposition without the running or waiting gauge counts as no
   signals.
2. `<url>/stats` (in_flight, queue, p50_ms, as the stand-in and cpn-aware servers answer): the
   load when /metrics gave none, and the per-request latency (p50_ms) in any case.
3. Else `<url>/healthz`, else `<url>/`: a server that answers at all is healthy, load unknown.
4. `<url>/v1/models` (vLLM's model cards), on first contact, then every `models_every_s` (60 s)
   or when vllm:lora_requests_info names an adapter it did not list: the model's
   `max_model_len` and the LoRA adapters served (cards whose `parent` is set; at most
   MAX_ADAPTERS). A failed read keeps what the last one said.

A connection error, or no answer from /healthz in time, marks the endpoint unhealthy until it
answers again (a /metrics or /stats that times out only counts as no signals). A server
that answers but whose signals cannot be read this round keeps its last signals and their
time (`signals_at`), so routing sees them age and counts them as saturated once stale.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sites.model.spec import Service
from sites.model.status import MAX_ADAPTERS

log = logging.getLogger(__name__)

__all__ = [
    "Histogram",
    "ModelCards",
    "ServiceLoad",
    "ServiceMonitor",
    "Signals",
    "parse_models",
    "parse_signals",
]

MAX_METRICS_BYTES = 4 * 1024 * 1024  # a vLLM exposition is ~50 kB; refuse a runaway one
MAX_MODELS_BYTES = 1024 * 1024  # /v1/models: a card is ~400 bytes
MAX_ADAPTER_NAME = 256
MODELS_EVERY_S = 60.0

# signal -> the metric names that carry it, first found wins (vLLM V0 and V1, SGLang)
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
PREFIX_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
HIT_RATE = ("sglang:cache_hit_rate",)  # a gauge: SGLang reports the rate itself
LORA_INFO = "vllm:lora_requests_info"


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
    prefix_queries: float | None = None  # counters since the server started, in tokens
    prefix_hits: float | None = None
    hit_rate: float | None = None  # a server's own hit-rate gauge (SGLang)
    lora_adapters: tuple[str, ...] | None = None  # running or waiting; None: no LoRA metric

    def prefix_since(self, before: Signals | None) -> float | None:
        """Hits / queries since `before` (a counter reset: since the start); None when there
        were no queries, or the server counts none (then its own rate gauge, if any)."""
        if self.prefix_queries is None or self.prefix_hits is None:
            return None if self.hit_rate is None else min(1.0, max(0.0, self.hit_rate))
        queries, hits = self.prefix_queries, self.prefix_hits
        if (
            before is not None
            and before.prefix_queries is not None
            and before.prefix_hits is not None
            and before.prefix_queries <= queries
            and before.prefix_hits <= hits
        ):
            queries -= before.prefix_queries
            hits -= before.prefix_hits
        if queries <= 0:
            return None
        return min(1.0, max(0.0, hits / queries))


def parse_signals(text: str) -> Signals | None:
    """The signals in a Prometheus text exposition; None when it has no running and waiting
    gauges of a known server. ValueError when the text is not an exposition."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    lora: tuple[str, ...] | None = None
    for family in text_string_to_metric_families(text):
        name = family.name
        if name in TTFT and family.type == "histogram":
            histograms[name] = _histogram(family.samples)
        elif name in RUNNING or name in WAITING or name in KV_USAGE or name in HIT_RATE:
            gauges[name] = sum(s.value for s in family.samples if math.isfinite(s.value))
        elif name in PREFIX_QUERIES or name in PREFIX_HITS:
            counters[name] = sum(
                s.value
                for s in family.samples
                if math.isfinite(s.value) and not s.name.endswith("_created")
            )
        elif name == LORA_INFO:
            lora = _lora_adapters(family.samples)
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
        prefix_queries=_first(counters, PREFIX_QUERIES),
        prefix_hits=_first(counters, PREFIX_HITS),
        hit_rate=_first(gauges, HIT_RATE),
        lora_adapters=lora,
    )


def _lora_adapters(samples: Iterable[Any]) -> tuple[str, ...]:
    """The adapters running or waiting by the newest sample (vLLM sets each label set's value
    to the time it was current, and may keep older ones)."""
    newest = max(samples, key=lambda s: s.value, default=None)
    if newest is None:
        return ()
    names: set[str] = set()
    for label in ("running_lora_adapters", "waiting_lora_adapters"):
        names.update(n.strip() for n in newest.labels.get(label, "").split(","))
    return tuple(sorted(n for n in names if n))


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
    prefix_cache_hit_rate: float | None = None  # since the previous scrape, 0..1
    max_model_len: int | None = None  # from /v1/models
    adapters: tuple[str, ...] = ()  # LoRA adapters served (/v1/models, vllm:lora_requests_info)

    def signal_fields(self) -> dict[str, Any]:
        """The model-server signals as sites.model.status.ServiceEndpoint's fields."""
        return {
            "kv_cache_usage": self.kv_cache_usage,
            "ttft_ms": self.ttft_ms,
            "ttft_p95_ms": self.ttft_p95_ms,
            "signals": self.signals,
            "signals_at": self.signals_at,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "max_model_len": self.max_model_len,
            "adapters": self.adapters,
        }


@dataclass(frozen=True)
class ModelCards:
    """What a server's /v1/models said, and when it was last asked (the monitor's clock)."""

    max_model_len: int | None
    adapters: tuple[str, ...]
    asked_at: float
    lora_seen: tuple[str, ...] = ()  # the running/waiting adapters when it was asked


def parse_models(data: object) -> tuple[int | None, tuple[str, ...]]:
    """(max_model_len, adapters) of a vLLM ModelList: the base model's (a card without
    `parent`) context length, and the cards with a `parent` (LoRA adapters), sorted, at most
    MAX_ADAPTERS. ValueError when it is not a model list."""
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        raise ValueError("not a model list")
    cards = [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
    base = [c for c in cards if not c.get("parent")]
    lengths = [
        c["max_model_len"]
        for c in (*base, *cards)
        if isinstance(c.get("max_model_len"), int)
        and not isinstance(c["max_model_len"], bool)
        and c["max_model_len"] > 0
    ]
    adapters = sorted(
        {
            c["id"]
            for c in cards
            if isinstance(c.get("parent"), str) and 0 < len(c["id"]) <= MAX_ADAPTER_NAME
        }
    )
    return (lengths[0] if lengths else None), tuple(adapters[:MAX_ADAPTERS])


class ServiceMonitor:
    def __init__(
        self,
        services: tuple[Service, ...],
        *,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        by_url: bool = False,
        models_every_s: float = MODELS_EVERY_S,
    ) -> None:
        self.services = services
        self.timeout_s = timeout_s
        self.clock = clock  # unix s, for signals_at
        # loads by service name, or by URL (by_url: several replicas of one service at a site)
        self._key: Callable[[Service], str] = _url if by_url else _name
        self.loads: dict[str, ServiceLoad] = {}
        self._ttft: dict[str, Histogram] = {}  # the last scrape's histogram, per key
        self._scraped: dict[str, Signals] = {}  # the last scrape, per key (prefix-cache deltas)
        self.models_every_s = models_every_s
        self.cards: dict[str, ModelCards] = {}  # what /v1/models said, per key
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
        for kept in (self._ttft, self._scraped, self.cards):  # servers gone: forget them
            for gone in kept.keys() - self.loads.keys():
                del kept[gone]

    async def _poll(self, session: aiohttp.ClientSession, svc: Service) -> ServiceLoad:
        load, lora = await self._load(session, svc)
        if not load.healthy:
            return load
        base, key = svc.url.rstrip("/"), self._key(svc)
        cards = self.cards.get(key)
        if self._cards_due(cards, lora):
            cards = await self._read_cards(session, base, cards, lora)
            self.cards[key] = cards
        if cards is None:
            return replace(load, adapters=lora or ())
        adapters = tuple(sorted({*cards.adapters, *(lora or ())}))[:MAX_ADAPTERS]
        return replace(load, max_model_len=cards.max_model_len, adapters=adapters)

    def _cards_due(self, cards: ModelCards | None, lora: tuple[str, ...] | None) -> bool:
        """First contact, the refresh interval, or an adapter running that /v1/models did not
        list (asked once per such set of adapters)."""
        if cards is None or self.clock() - cards.asked_at >= self.models_every_s:
            return True
        if not lora:
            return False
        return not set(lora) <= set(cards.adapters) and lora != cards.lora_seen

    async def _read_cards(
        self,
        session: aiohttp.ClientSession,
        base: str,
        last: ModelCards | None,
        lora: tuple[str, ...] | None,
    ) -> ModelCards:
        now = self.clock()
        try:
            async with session.get(base + "/v1/models") as resp:
                if resp.status != 200:
                    raise ValueError(f"/v1/models answered {resp.status}")
                raw = await resp.content.read(MAX_MODELS_BYTES + 1)
            if len(raw) > MAX_MODELS_BYTES:
                raise ValueError(f"/v1/models over {MAX_MODELS_BYTES} bytes")
            max_model_len, adapters = parse_models(json.loads(raw))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("%s/v1/models: %r", base, exc)
            if last is None:
                return ModelCards(None, (), now, lora or ())
            return replace(last, asked_at=now, lora_seen=lora or ())
        return ModelCards(max_model_len, adapters, now, lora or ())

    async def _load(
        self, session: aiohttp.ClientSession, svc: Service
    ) -> tuple[ServiceLoad, tuple[str, ...] | None]:
        """The load of one server, and the adapters its LoRA metric names (None: no metric)."""
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
                hit_rate = signals.prefix_since(self._scraped.get(key))
                self._scraped[key] = signals
                load = ServiceLoad(
                    healthy=True,
                    in_flight=signals.running,
                    queue=signals.waiting,
                    latency_ms=None if stats is None else _float(stats.get("p50_ms")),
                    kv_cache_usage=signals.kv_cache_usage,
                    ttft_ms=None if ttft is None else _round(ttft.mean_ms()),
                    ttft_p95_ms=None if ttft is None else _round(ttft.quantile_ms(0.95)),
                    signals=signals.source,
                    signals_at=now,
                    prefix_cache_hit_rate=_round(hit_rate),
                )
                return load, signals.lora_adapters
            if stats is not None:
                load = ServiceLoad(
                    healthy=True,
                    in_flight=int(stats.get("in_flight", 0)),
                    queue=int(stats.get("queue", 0)),
                    latency_ms=_float(stats.get("p50_ms")),
                    signals="stats",
                    signals_at=now,
                )
                return load, None
            for path in ("/healthz", "/"):
                async with session.get(base + path) as resp:
                    if resp.status < 500:
                        return self._unread(key, healthy=resp.status < 400 or path == "/"), None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("service %s at %s: %r", svc.name, svc.url, exc)
        return ServiceLoad(healthy=False), None

    def _unread(self, service: str, *, healthy: bool) -> ServiceLoad:
        """A server that answers without signals this round: its last ones, at their old time."""
        last = self.loads.get(service)
        if last is None or last.signals is None:
            return ServiceLoad(healthy=healthy)
        return replace(
            last, healthy=healthy, ttft_ms=None, ttft_p95_ms=None, prefix_cache_hit_rate=None
        )

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
