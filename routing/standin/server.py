"""A STAND-IN model server for tests and the demo. It runs no model.

It answers OpenAI-like requests after a service time drawn from a declared distribution, so the
router has something with realistic latency, a concurrency limit and a queue to route to. Every
response carries `X-Cpn-Standin: 1` so nobody mistakes it for a real inference server.

    POST /v1/completions, POST /v1/chat/completions
        JSON object in; after the service time, a small JSON completion out. With
        `"stream": true` it sends server-sent events instead: `max_tokens` (default `tokens`)
        `data: {...}` events spaced by service_time / tokens, then `data: [DONE]`.
    GET /healthz          200 while healthy (the fault switch applies here too)
    GET /stats            {in_flight, queue, served, errors, rejected, p50_ms, p99_ms,
                           mean_ms, service_rate_per_s, max_concurrency, max_queue,
                           kv_cache_usage, prefix_queries, prefix_hits, ...}
    GET /metrics          Prometheus text with vLLM's names and types, labelled model_name:
                          vllm:num_requests_running, vllm:num_requests_waiting (gauges),
                          vllm:gpu_cache_usage_perc (gauge, 0..1),
                          vllm:time_to_first_token_seconds (histogram, vLLM's buckets),
                          vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total
                          (counters, prompt tokens)
    POST /admin/fail      {"mode": "500" | "hang" | "slow" | "blind" | "ok"}: a fault switch for
                          tests; "blind" answers 503 to /metrics and /stats only (a server too
                          busy to report, whose signals then go stale), inference still works

Service time: lognormal with the declared median and p99 (p99 == median gives a constant),
drawn from a seeded generator. Concurrency: at most `max_concurrency` requests are served at
once; the next `max_queue` wait in FIFO order; beyond that the answer is 429 with Retry-After.
p50/p99/mean are over the service times of the last WINDOW_S seconds (at most `window` of
them; queueing excluded, the way the router's service estimate wants them), so a burst of slow
answers ages out; service_rate_per_s = max_concurrency / mean service time.

Time to first token: the queue wait, then a prefill of `prefill_ms` (times 1 - prefix_hit_discount
when the prompt's prefix was recently served: routing.standin.kvcache.PrefixCache), then the first
of
`max_tokens` tokens spaced by service_time / max_tokens. A running request holds KV blocks for
its prompt and output tokens (routing.standin.kvcache.KvCache); /metrics reports the cache's usage.

Run: python -m routing.standin.server --listen HOST:PORT --name NAME --median-ms X --p99-ms Y
     --max-concurrency N [--max-queue M] [--seed S] [--tokens T] [--prefill-ms P]
     [--prefix-hit-discount D] [--prefix-chars C] [--prefix-cache-entries E]
     [--kv-cache-blocks B]
--prefill-ms and --prefix-cache-entries default to $CPN_STANDIN_PREFILL_MS and
$CPN_STANDIN_PREFIX_CACHE_ENTRIES when set (so a `cpn up` started with them models the prefix
cache: bench/inference_routing.py's prefix workload), else 0 and 1024.
It prints `listening on http://HOST:PORT` once it accepts connections (PORT 0 picks one).

One module because it is one small program started as `python -m routing.standin.server`
(and under its old name, routing.modelserver) wherever a replica runs: the settings, the
queue, the HTTP handlers and the command line read as one file, and nothing else imports its
parts but the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hmac
import importlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from routing.standin.kvcache import KvCache, PrefixCache, PromptError, prompt_text, tokens_of

__all__ = [
    "FAULT_MODES",
    "ModelServer",
    "ModelServerSettings",
    "ServiceTime",
    "main",
    "make_app",
]

STANDIN_HEADER = "X-Cpn-Standin"
FAULT_MODES = ("ok", "500", "hang", "slow", "blind")
WINDOW_S = 10.0  # /stats covers the service times of the last 10 s
SLOW_FACTOR = 50  # "slow": every service time x 50, so requests pile up (an overloaded site)
MAX_BODY = 1024 * 1024
MAX_STREAM_TOKENS = 4096
_Z99 = statistics.NormalDist().inv_cdf(0.99)
# vLLM's own buckets for vllm:time_to_first_token_seconds (vllm/engine/metrics.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0)  # fmt: skip


class ModelServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, description="shown in responses and /stats")
    median_ms: float = Field(gt=0, description="median service time")
    p99_ms: float = Field(gt=0, description="99th percentile service time (>= median_ms)")
    max_concurrency: int = Field(ge=1, description="requests served at once")
    max_queue: int = Field(64, ge=0, description="requests that may wait for a slot; then 429")
    seed: int = Field(0, description="seeds the service-time draws, for repeatable runs")
    tokens: int = Field(8, ge=1, le=MAX_STREAM_TOKENS, description="events in a stream")
    window: int = Field(1000, ge=1, description="recent service times kept for /stats")
    prefill_ms: float = Field(
        0.0, ge=0, description="ms before the first token on a prefix-cache miss (0: none)"
    )
    prefix_hit_discount: float = Field(
        0.8, ge=0, le=1, description="fraction of prefill_ms a prefix-cache hit saves"
    )
    prefix_chars: int = Field(
        256, ge=1, description="leading characters of the prompt that make its prefix key"
    )
    prefix_cache_entries: int = Field(1024, ge=1, description="prefix keys kept (LRU)")
    kv_cache_blocks: int = Field(
        4096, ge=1, description="KV-cache capacity in blocks; usage = held / this"
    )
    kv_block_tokens: int = Field(16, ge=1, description="tokens per KV block (vLLM's default)")
    api_key: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="as vLLM's --api-key: /v1/ requests without `Authorization: Bearer <key>` "
        "get a 401 (None: no key)",
    )

    @model_validator(mode="after")
    def _p99_above_median(self) -> ModelServerSettings:
        if self.p99_ms < self.median_ms:
            raise ValueError(f"p99_ms ({self.p99_ms:g}) must be >= median_ms ({self.median_ms:g})")
        return self


class ServiceTime:
    """Lognormal service times in ms with a given median and p99, from a seeded generator."""

    def __init__(self, *, median_ms: float, p99_ms: float, seed: int) -> None:
        if not 0 < median_ms <= p99_ms:
            raise ValueError("need 0 < median_ms <= p99_ms")
        self.mu = math.log(median_ms)
        self.sigma = math.log(p99_ms / median_ms) / _Z99
        self.mean_ms = math.exp(self.mu + self.sigma**2 / 2)
        self._rng = random.Random(seed)

    def draw(self) -> float:
        return self._rng.lognormvariate(self.mu, self.sigma)


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


class _Slots:
    """max_concurrency slots with a bounded FIFO queue of waiters."""

    def __init__(self, capacity: int, max_queue: int) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_flight = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.in_flight < self.capacity and not self.waiters:
            self.in_flight += 1
            return
        if len(self.waiters) >= self.max_queue:
            raise QueueFull
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            else:
                self.waiters.remove(fut)
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to the waiter; in_flight is unchanged
                return
        self.in_flight -= 1


class ModelServer:
    """The stand-in's state: slots, the fault switch, recent service times, counters."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.service_time = ServiceTime(
            median_ms=settings.median_ms, p99_ms=settings.p99_ms, seed=settings.seed
        )
        self.slots = _Slots(settings.max_concurrency, settings.max_queue)
        self.mode = "ok"
        self._recovered = asyncio.Event()
        self._recovered.set()
        # (monotonic time, service ms): figures cover the last `window` times of the last
        # WINDOW_S seconds, so a burst of slow answers ages out even when no traffic follows
        self.recent: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=settings.window
        )
        self.served = 0
        self.errors = 0
        self.rejected = 0
        self._ids: Iterator[int] = itertools.count(1)
        self.kv = KvCache(
            capacity_blocks=settings.kv_cache_blocks, block_tokens=settings.kv_block_tokens
        )
        self.prefixes = PrefixCache(
            chars=settings.prefix_chars, entries=settings.prefix_cache_entries
        )
        self.metrics = _Metrics(settings.name)

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == "hang":
            self._recovered.clear()
        else:
            self._recovered.set()  # releases hung requests

    async def fault(self) -> web.Response | None:
        """The response the fault switch imposes, or None when healthy."""
        if self.mode == "hang":
            await self._recovered.wait()
        if self.mode == "500":
            self.errors += 1
            return _error(500, "injected_fault", f"{self.settings.name}: fault switch is on")
        return None

    def retry_after_s(self) -> int:
        """A queued request's expected wait: the queue drains max_concurrency per service time."""
        per_slot_ms = self.mean_ms() / self.settings.max_concurrency
        return max(1, math.ceil((len(self.slots.waiters) + 1) * per_slot_ms / 1000))

    @property
    def recent_ms(self) -> list[float]:
        horizon = time.monotonic() - WINDOW_S
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        return [ms for _, ms in self.recent]

    def record(self, service_ms: float) -> None:
        self.recent.append((time.monotonic(), service_ms))

    def mean_ms(self) -> float:
        recent = self.recent_ms
        if recent:
            return statistics.fmean(recent)
        return self.service_time.mean_ms

    def stats(self) -> dict[str, Any]:
        recent = sorted(self.recent_ms)
        mean_ms = self.mean_ms()
        return {
            "name": self.settings.name,
            "standin": True,
            "mode": self.mode,
            "in_flight": self.slots.in_flight,
            "queue": len(self.slots.waiters),
            "served": self.served,
            "errors": self.errors,
            "rejected": self.rejected,
            "p50_ms": _quantile(recent, 0.50),
            "p99_ms": _quantile(recent, 0.99),
            "mean_ms": round(mean_ms, 3),
            "window": len(recent),
            "service_rate_per_s": round(self.settings.max_concurrency * 1000 / mean_ms, 3),
            "max_concurrency": self.settings.max_concurrency,
            "max_queue": self.settings.max_queue,
            "kv_cache_usage": round(self.kv.usage, 4),
            "prefix_queries": self.prefixes.queries,
            "prefix_hits": self.prefixes.hits,
        }

    def next_id(self) -> int:
        return next(self._ids)

    def exposition(self) -> bytes:
        """/metrics: the gauges as of now, the histogram and counters as they accumulated."""
        m = self.metrics
        m.running.set(self.slots.in_flight)
        m.waiting.set(len(self.slots.waiters))
        m.kv_usage.set(self.kv.usage)
        return generate_latest(m.registry)


class _Metrics:
    """The vLLM-named series of one server, in a registry of its own (tests run several)."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ("model_name",)
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests currently running on GPU.",
            label, registry=r,
        ).labels(model)  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            label, registry=r,
        ).labels(model)  # fmt: skip
        self.kv_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
            label, registry=r,
        ).labels(model)  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            label, registry=r, buckets=TTFT_BUCKETS_S,
        ).labels(model)  # fmt: skip
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
            "tokens.", label, registry=r,
        ).labels(model)  # fmt: skip
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            label, registry=r,
        ).labels(model)  # fmt: skip


def _quantile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank quantile of sorted values; None when there are none."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 3)


def _error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message, "field": field}}, status=status
    )


SERVER = web.AppKey("modelserver", ModelServer)


async def _read_json(request: web.Request) -> dict[str, Any] | web.Response:
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _error(413, "too_large", f"request body over {MAX_BODY} bytes", "body")
    try:
        body = json.loads(await request.read() or b"{}")
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "too_large", f"request body over {MAX_BODY} bytes", "body")
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, "invalid_json", f"request body is not JSON: {exc}", "body")
    if not isinstance(body, dict):
        return _error(400, "invalid", "request body must be a JSON object", "body")
    return body


def _token_count(body: dict[str, Any], default: int) -> int | web.Response:
    value = body.get("max_tokens", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STREAM_TOKENS:
        return _error(
            400, "invalid", f"max_tokens must be an integer in 1..{MAX_STREAM_TOKENS}", "max_tokens"
        )
    return value


async def _infer(request: web.Request, chat: bool) -> web.StreamResponse:
    server = request.app[SERVER]
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _error(400, "invalid", "stream must be true or false", "stream")
    tokens = _token_count(body, server.settings.tokens)
    if isinstance(tokens, web.Response):
        return tokens
    try:
        prompt = prompt_text(body, chat=chat)
    except PromptError as exc:
        return _error(400, "invalid", str(exc), exc.field)
    arrived = time.monotonic()
    fault = await server.fault()
    if fault is not None:
        return fault
    try:
        await server.slots.acquire()
    except QueueFull:
        server.rejected += 1
        busy = _error(
            429,
            "queue_full",
            f"{server.settings.name}: {server.settings.max_concurrency} in flight and "
            f"{server.settings.max_queue} queued",
        )
        busy.headers["Retry-After"] = str(server.retry_after_s())
        return busy
    prompt_tokens = tokens_of(prompt)
    blocks = server.kv.hold(prompt_tokens + tokens)
    try:
        service_ms = server.service_time.draw() * (SLOW_FACTOR if server.mode == "slow" else 1)
        rid = f"cmpl-{server.settings.name}-{server.next_id()}"
        run = _Run(server, prompt, prompt_tokens, tokens, service_ms, arrived)
        response: web.StreamResponse
        if stream:
            response = await _stream(request, run, rid, chat)
        else:
            await run.first_token()
            await asyncio.sleep(run.per_token_s * (tokens - 1))
            response = web.json_response(_completion(run, rid, chat))
        server.record(service_ms)
        server.served += 1
        return response
    finally:
        server.kv.release(blocks)
        server.slots.release()


class _Run:
    """One admitted request: its prefill (discounted on a prefix hit) and token pacing."""

    def __init__(
        self,
        server: ModelServer,
        prompt: str,
        prompt_tokens: int,
        tokens: int,
        service_ms: float,
        arrived: float,
    ) -> None:
        settings = server.settings
        self.server = server
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
        self.service_ms = service_ms
        self.arrived = arrived
        self.per_token_s = service_ms / tokens / 1000
        self.key = server.prefixes.key(prompt)
        self.hit = server.prefixes.lookup(self.key)
        discount = settings.prefix_hit_discount if self.hit else 0.0
        self.prefill_ms = settings.prefill_ms * (1 - discount)
        self.ttft_ms: float | None = None
        cached = min(prompt_tokens, tokens_of(prompt[: settings.prefix_chars])) if self.hit else 0
        server.metrics.prefix_queries.inc(prompt_tokens)
        server.metrics.prefix_hits.inc(cached)

    async def first_token(self) -> None:
        """Sleep through the prefill and the first token; record the time to first token (from
        arrival, queueing included, as vLLM measures it)."""
        await asyncio.sleep(self.prefill_ms / 1000 + self.per_token_s)
        self.server.prefixes.store(self.key)
        ttft_s = time.monotonic() - self.arrived
        self.ttft_ms = ttft_s * 1000
        self.server.metrics.ttft.observe(ttft_s)


def _completion(run: _Run, rid: str, chat: bool) -> dict[str, Any]:
    server, tokens = run.server, run.tokens
    text = " ".join(f"tok{i}" for i in range(tokens))
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        if chat
        else {"index": 0, "text": text, "finish_reason": "stop"}
    )
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": server.settings.name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": run.prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": run.prompt_tokens + tokens,
        },
        "cpn": {
            "standin": True,
            "server": server.settings.name,
            "service_ms": round(run.service_ms, 3),
            "prefill_ms": round(run.prefill_ms, 3),
            "prefix_hit": run.hit,
            "ttft_ms": None if run.ttft_ms is None else round(run.ttft_ms, 3),
        },
    }


async def _stream(request: web.Request, run: _Run, rid: str, chat: bool) -> web.StreamResponse:
    server, tokens = run.server, run.tokens
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    kind = "chat.completion.chunk" if chat else "text_completion"
    try:
        for i in range(tokens):
            if i == 0:
                await run.first_token()
            else:
                await asyncio.sleep(run.per_token_s)
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": f"tok{i} "}}
                if chat
                else {"index": 0, "text": f"tok{i} "}
            )
            if i == tokens - 1:
                choice["finish_reason"] = "stop"
            event = {"id": rid, "object": kind, "model": server.settings.name, "choices": [choice]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        pass  # the client left; aiohttp closes the connection
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _infer(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _infer(request, chat=True)


async def healthz(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    fault = await server.fault()
    if fault is not None:
        return fault
    return web.json_response({"status": "ok", "name": server.settings.name, "standin": True})


async def stats(request: web.Request) -> web.Response:
    if request.app[SERVER].mode == "blind":
        return _error(503, "blind", "fault switch: no load report")
    return web.json_response(request.app[SERVER].stats())


async def metrics(request: web.Request) -> web.Response:
    if request.app[SERVER].mode == "blind":
        return _error(503, "blind", "fault switch: no load report")
    # Content-Type carries its own charset parameter, so it goes in as a raw header
    return web.Response(
        body=request.app[SERVER].exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def admin_fail(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    mode = body.get("mode")
    if mode not in FAULT_MODES:
        return _error(400, "invalid", f"mode must be one of {', '.join(FAULT_MODES)}", "mode")
    server.set_mode(mode)
    return web.json_response({"mode": mode})


async def _mark_standin(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers[STANDIN_HEADER] = "1"


async def _release_hung(app: web.Application) -> None:
    # Hung requests would hold shutdown for the whole graceful timeout.
    app[SERVER].set_mode("ok")


def make_app(settings: ModelServerSettings) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[SERVER] = ModelServer(settings)
    app.on_response_prepare.append(_mark_standin)
    if settings.api_key is not None:
        app.middlewares.append(_require_key(settings.api_key))
    app.on_shutdown.append(_release_hung)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/admin/fail", admin_fail)
    return app


def _require_key(key: str) -> Middleware:
    """vLLM's check of its --api-key: a /v1/ request needs `Authorization: Bearer <key>`,
    else 401 {"error": "Unauthorized"}; /healthz, /metrics and /stats stay open."""
    expected = f"Bearer {key}"

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") and not hmac.compare_digest(
            request.headers.get("Authorization", ""), expected
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return require_key


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m routing.standin.server",
        description="A stand-in model server (runs no model) for cpn tests and the demo.",
    )
    p.add_argument("--listen", type=_parse_listen, required=True, metavar="HOST:PORT")
    p.add_argument("--name", required=True)
    p.add_argument("--median-ms", type=float, required=True)
    p.add_argument("--p99-ms", type=float, required=True)
    p.add_argument("--max-concurrency", type=int, required=True)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=8, help="events in a streamed answer")
    # the prefix-cache model's defaults may come from the environment: `cpn up` passes the
    # stand-ins only their timing and size, and a benchmark (bench/inference_routing.py) sets these
    p.add_argument(
        "--prefill-ms",
        type=float,
        default=float(os.environ.get("CPN_STANDIN_PREFILL_MS", "0")),
        help="prefill on a prefix miss (default: $CPN_STANDIN_PREFILL_MS, else 0)",
    )
    p.add_argument("--prefix-hit-discount", type=float, default=0.8)
    p.add_argument("--prefix-chars", type=int, default=256)
    p.add_argument(
        "--prefix-cache-entries",
        type=int,
        default=int(os.environ.get("CPN_STANDIN_PREFIX_CACHE_ENTRIES", "1024")),
        help="prefix keys kept, LRU (default: $CPN_STANDIN_PREFIX_CACHE_ENTRIES, else 1024)",
    )
    p.add_argument("--kv-cache-blocks", type=int, default=4096)
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="require the key in this environment variable on /v1/ requests (vLLM's --api-key)",
    )
    return p


async def serve(settings: ModelServerSettings, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    runner = web.AppRunner(make_app(settings), access_log=None, shutdown_timeout=5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        print(f"listening on http://{shown}:{bound[1]}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    host, port = args.listen
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "").strip()
        if not api_key:
            print(f"modelserver: --api-key-env: {args.api_key_env} is not set", file=sys.stderr)
            return 2
    try:
        settings = ModelServerSettings(
            name=args.name,
            median_ms=args.median_ms,
            p99_ms=args.p99_ms,
            max_concurrency=args.max_concurrency,
            max_queue=args.max_queue,
            seed=args.seed,
            tokens=args.tokens,
            prefill_ms=args.prefill_ms,
            prefix_hit_discount=args.prefix_hit_discount,
            prefix_chars=args.prefix_chars,
            prefix_cache_entries=args.prefix_cache_entries,
            kv_cache_blocks=args.kv_cache_blocks,
            api_key=api_key,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"modelserver: {where + ': ' if where else ''}{first['msg']}", file=sys.stderr)
        return 2
    loop_factory = None
    with contextlib.suppress(ImportError):
        loop_factory = importlib.import_module("uvloop").new_event_loop  # used when installed
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(settings, host, port))
    except OSError as exc:
        print(
            f"modelserver: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
