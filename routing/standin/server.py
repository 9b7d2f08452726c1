"""A STAND-IN model server for tests and the demo. It runs no model.

It answers OpenAI requests as vLLM's OpenAI server does, after a service time drawn from a
declared distribution, so the router has something with realistic latency, a concurrency
limit and a queue to route to, and the gateway real `usage` to meter. Every response carries
`X-Cpn-Standin: 1` so nobody mistakes it for a real inference server.

    POST /v1/completions, POST /v1/chat/completions
        JSON object in; after the service time, a completion of `max_tokens` (default
        `tokens`) tokens out, with `usage` (prompt tokens counted from the input by
        routing.standin.tokens, `prompt_tokens_details.cached_tokens` on a prefix-cache hit).
        With `"stream": true`: server-sent events, one per token, spaced by
        service_time / tokens, then `data: [DONE]`; with `stream_options.include_usage` every
        chunk has `"usage": null` and a last chunk `"choices": []` carries the usage
        (`continuous_usage_stats`: every chunk carries the usage so far, as vLLM).
    POST /v1/embeddings   deterministic unit vectors (routing.standin.embeddings)
    GET /v1/models, GET /v1/models/{id}
                          vLLM's model cards: the model and its LoRA adapters
                          (routing.standin.models, which also says which `model` a request
                          may name: an unknown one is a 404 once --served-model-name is given)
    GET /healthz          200 while healthy (the fault switch applies here too)
    GET /stats            {in_flight, queue, served, errors, rejected, p50_ms, p99_ms,
                           mean_ms, service_rate_per_s, max_concurrency, max_queue,
                           kv_cache_usage, prefix_queries, prefix_hits, ...}
    GET /metrics          Prometheus text with vLLM V1's names and types, labelled
                          model_name and engine:
                          vllm:num_requests_running, vllm:num_requests_waiting (gauges),
                          vllm:kv_cache_usage_perc (gauge, 0..1),
                          vllm:time_to_first_token_seconds (histogram, vLLM's buckets),
                          vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total
                          (counters, prompt tokens looked up and found),
                          vllm:prompt_tokens_total, vllm:generation_tokens_total (counters);
                          with adapters, vllm:lora_requests_info{max_lora,
                          running_lora_adapters, waiting_lora_adapters} (gauge, unix s)
    POST /admin/fail      {"mode": "500" | "hang" | "slow" | "blind" | "ok"}: a fault switch for
                          tests; "blind" answers 503 to /metrics and /stats only (a server too
                          busy to report, whose signals then go stale), inference still works

Errors on /v1/ are vLLM's `{"error": {"message", "type", "param", "code"}}` (code: the HTTP
status; routing.standin.errors), with cpn's `field` beside `param`.

Service time: lognormal with the declared median and p99 (p99 == median gives a constant),
drawn from a seeded generator. Concurrency: at most `max_concurrency` requests are served at
once; the next `max_queue` wait in FIFO order; beyond that the answer is 429 with Retry-After.
p50/p99/mean are over the service times of the last WINDOW_S seconds (at most `window` of
them; queueing excluded, the way the router's service estimate wants them), so a burst of slow
answers ages out; service_rate_per_s = max_concurrency / mean service time.

Time to first token: the queue wait, then a prefill of `prefill_ms` (times 1 - prefix_hit_discount
when the prompt's prefix was recently served: routing.standin.kvcache.PrefixCache), then the first
of `max_tokens` tokens spaced by service_time / max_tokens. A running request holds KV blocks for
its prompt and output tokens (routing.standin.kvcache.KvCache); /metrics reports the cache's usage.

Run: python -m routing.standin.server --listen HOST:PORT --name NAME --median-ms X --p99-ms Y
     --max-concurrency N [--max-queue M] [--seed S] [--tokens T] [--prefill-ms P]
     [--prefix-hit-discount D] [--prefix-chars C] [--prefix-cache-entries E]
     [--kv-cache-blocks B] [--served-model-name MODEL] [--lora-modules NAME[=PATH] ...]
     [--max-loras L] [--max-model-len LEN] [--embedding-dim D] [--api-key-env VAR]
--prefill-ms and --prefix-cache-entries default to $CPN_STANDIN_PREFILL_MS and
$CPN_STANDIN_PREFIX_CACHE_ENTRIES when set (so a `cpn up` started with them models the prefix
cache: bench/inference_routing.py's prefix workload), else 0 and 1024.
It prints `listening on http://HOST:PORT` once it accepts connections (PORT 0 picks one).

One module for the program's settings, queue, HTTP handlers and command line, started as
`python -m routing.standin.server` (and under its old name, routing.modelserver) wherever a
replica runs (past 600 lines: the handlers share the server's state and read as one); what the
OpenAI surface computes (tokens, models, embeddings, errors), the service times and slots
(queueing) and the metric series (metrics) are in the modules beside it.
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
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from routing.standin.embeddings import EmbeddingRequest
from routing.standin.errors import ApiError, error_body
from routing.standin.kvcache import KvCache, PrefixCache, prompt_text
from routing.standin.metrics import VllmMetrics
from routing.standin.models import Catalog, LoraAdapter, parse_lora
from routing.standin.queueing import QueueFull, ServiceTime, Slots
from routing.standin.tokens import cached_tokens, chat_tokens, prompt_tokens, text_tokens, usage

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
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="the model requests name, as vLLM's --served-model-name: another name is a "
        "404; None: the model is `name`, and a request may name any model (the stand-in "
        "answered every name before models were routed by name)",
    )
    lora_adapters: tuple[LoraAdapter, ...] = Field(
        (), description="LoRA adapters served beside the model (vLLM's --lora-modules)"
    )
    max_loras: int = Field(
        1, ge=1, description="vllm:lora_requests_info's max_lora label (vLLM's --max-loras)"
    )
    max_model_len: int = Field(
        32768, ge=1, description="context length in tokens: prompt + max_tokens beyond it is a 400"
    )
    embedding_dim: int = Field(384, ge=1, le=8192, description="length of /v1/embeddings vectors")
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

    @model_validator(mode="after")
    def _adapters_distinct(self) -> ModelServerSettings:
        names = [a.name for a in self.lora_adapters]
        if len(set(names)) != len(names) or self.model in names:
            raise ValueError("lora_adapters: each name once, and none the served model's")
        return self

    @property
    def model(self) -> str:
        """The served model's name: what responses and metrics say."""
        return self.served_model_name or self.name


class ModelServer:
    """The stand-in's state: slots, the fault switch, recent service times, counters."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.service_time = ServiceTime(
            median_ms=settings.median_ms, p99_ms=settings.p99_ms, seed=settings.seed
        )
        self.slots = Slots(settings.max_concurrency, settings.max_queue)
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
        self.catalog = Catalog(
            model=settings.model,
            adapters=settings.lora_adapters,
            max_model_len=settings.max_model_len,
            strict=settings.served_model_name is not None,
        )
        # requests per adapter, running and waiting for a slot (vllm:lora_requests_info)
        self.lora_running: collections.Counter[str] = collections.Counter()
        self.lora_waiting: collections.Counter[str] = collections.Counter()
        self.metrics = VllmMetrics(settings.model, lora=bool(settings.lora_adapters))

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
            return web.json_response(
                error_body(500, f"{self.settings.name}: fault switch is on (injected_fault)"),
                status=500,
            )
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
        if m.lora_info is not None:
            # one label set, the adapters as of now, valued at the time (vLLM sets it so)
            m.lora_info.clear()
            m.lora_info.labels(
                max_lora=str(self.settings.max_loras),
                waiting_lora_adapters=_names(self.lora_waiting),
                running_lora_adapters=_names(self.lora_running),
            ).set(time.time())
        return generate_latest(m.registry)


def _names(counts: collections.Counter[str]) -> str:
    return ",".join(sorted(name for name, n in counts.items() if n > 0))


def _quantile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank quantile of sorted values; None when there are none."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 3)


def _error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    """cpn's error shape, for the stand-in's own paths (/admin, /stats, /metrics)."""
    return web.json_response(
        {"error": {"code": code, "message": message, "field": field}}, status=status
    )


def _api_error(exc: ApiError) -> web.Response:
    """vLLM's error shape, for the OpenAI paths (routing.standin.errors)."""
    return web.json_response(exc.body(), status=exc.status)


SERVER = web.AppKey("modelserver", ModelServer)


async def _read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; ApiError (400, 413) naming `body` when it is not one."""
    too_large = ApiError(f"request body over {MAX_BODY} bytes", param="body", status=413)
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise too_large
    try:
        body = json.loads(await request.read() or b"{}")
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"request body is not JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object", param="body")
    return body


def _flag(value: object, param: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{param} must be true or false", param=param)
    return value


class _Request:
    """A completion request, validated: what to generate, for which model, how to answer."""

    def __init__(self, server: ModelServer, body: dict[str, Any], *, chat: bool) -> None:
        settings = server.settings
        self.stream = _flag(body.get("stream", False), "stream")
        self.max_tokens = self._max_tokens(body, settings.tokens, chat=chat)
        options = body.get("stream_options")
        if options is not None and not self.stream:
            raise ApiError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if options is not None and not isinstance(options, dict):
            raise ApiError("stream_options must be an object", param="stream_options")
        options = options or {}
        self.include_usage = _flag(options.get("include_usage"), "stream_options.include_usage")
        self.continuous_usage = self.include_usage and _flag(
            options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats"
        )
        self.adapter = server.catalog.resolve(body.get("model"))
        self.model = self.adapter or settings.model
        if chat:
            self.prompt_tokens = chat_tokens(body.get("messages", []))
        else:
            self.prompt_tokens = prompt_tokens(body.get("prompt", ""))
        requested = self.prompt_tokens + self.max_tokens
        if requested > settings.max_model_len:
            where = "messages" if chat else "prompt"
            raise ApiError(
                f"This model's maximum context length is {settings.max_model_len} tokens. "
                f"However, you requested {requested} tokens ({self.prompt_tokens} in the "
                f"{where}, {self.max_tokens} in the completion). Please reduce the length of "
                f"the {where} or completion.",
                param=where,
            )
        self.prompt = prompt_text(body, chat=chat)

    @staticmethod
    def _max_tokens(body: dict[str, Any], default: int, *, chat: bool) -> int:
        # chat's max_completion_tokens is OpenAI's newer name for it; vLLM takes either
        param = (
            "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        )
        value = body.get(param)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_STREAM_TOKENS
        ):
            raise ApiError(f"{param} must be an integer in 1..{MAX_STREAM_TOKENS}", param=param)
        return value


def _busy(server: ModelServer) -> web.Response:
    server.rejected += 1
    busy = web.json_response(
        error_body(
            429,
            f"{server.settings.name}: {server.settings.max_concurrency} in flight and "
            f"{server.settings.max_queue} queued (queue_full)",
            type="RateLimitError",
        ),
        status=429,
    )
    busy.headers["Retry-After"] = str(server.retry_after_s())
    return busy


async def _infer(request: web.Request, chat: bool) -> web.StreamResponse:
    server = request.app[SERVER]
    try:
        req = _Request(server, await _read_json(request), chat=chat)
    except ApiError as exc:
        return _api_error(exc)
    arrived = time.monotonic()
    fault = await server.fault()
    if fault is not None:
        return fault
    adapter = req.adapter
    if adapter is not None:
        server.lora_waiting[adapter] += 1
    try:
        await server.slots.acquire()
    except QueueFull:
        return _busy(server)
    finally:
        if adapter is not None:
            server.lora_waiting[adapter] -= 1
    if adapter is not None:
        server.lora_running[adapter] += 1
    tokens = req.max_tokens
    blocks = server.kv.hold(req.prompt_tokens + tokens)
    try:
        service_ms = server.service_time.draw() * (SLOW_FACTOR if server.mode == "slow" else 1)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{server.settings.name}-{server.next_id()}"
        run = _Run(server, req, service_ms, arrived)
        response: web.StreamResponse
        if req.stream:
            response = await _stream(request, run, rid, chat)
        else:
            await run.first_token()
            await asyncio.sleep(run.per_token_s * (tokens - 1))
            server.metrics.generation_tokens.inc(tokens)
            response = web.json_response(_completion(run, rid, chat))
        server.record(service_ms)
        server.served += 1
        return response
    finally:
        server.kv.release(blocks)
        server.slots.release()
        if adapter is not None:
            server.lora_running[adapter] -= 1


class _Run:
    """One admitted request: its prefill (discounted on a prefix hit) and token pacing."""

    def __init__(
        self, server: ModelServer, req: _Request, service_ms: float, arrived: float
    ) -> None:
        settings = server.settings
        self.server = server
        self.req = req
        self.model = req.model
        self.prompt_tokens = req.prompt_tokens
        self.tokens = req.max_tokens
        self.service_ms = service_ms
        self.arrived = arrived
        self.per_token_s = service_ms / self.tokens / 1000
        self.key = server.prefixes.key(req.prompt)
        self.hit = server.prefixes.lookup(self.key)
        discount = settings.prefix_hit_discount if self.hit else 0.0
        self.prefill_ms = settings.prefill_ms * (1 - discount)
        self.ttft_ms: float | None = None
        prefix = text_tokens(req.prompt[: settings.prefix_chars])
        self.cached = (
            cached_tokens(prefix, self.prompt_tokens, settings.kv_block_tokens) if self.hit else 0
        )
        server.metrics.prefix_queries.inc(self.prompt_tokens)
        server.metrics.prefix_hits.inc(self.cached)

    def usage(self, completion: int) -> dict[str, Any]:
        return usage(self.prompt_tokens, completion, self.cached)

    async def first_token(self) -> None:
        """Sleep through the prefill and the first token; record the time to first token (from
        arrival, queueing included, as vLLM measures it)."""
        await asyncio.sleep(self.prefill_ms / 1000 + self.per_token_s)
        self.server.prefixes.store(self.key)
        self.server.metrics.prompt_tokens.inc(self.prompt_tokens)
        ttft_s = time.monotonic() - self.arrived
        self.ttft_ms = ttft_s * 1000
        self.server.metrics.ttft.observe(ttft_s)


def _completion(run: _Run, rid: str, chat: bool) -> dict[str, Any]:
    server, tokens = run.server, run.tokens
    text = " ".join(f"tok{i}" for i in range(tokens))
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
         "finish_reason": "stop"}
        if chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
    )  # fmt: skip
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": run.model,
        "choices": [choice],
        "usage": run.usage(tokens),
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
    """One event per token; with include_usage, `usage` null in each (or the usage so far,
    with continuous_usage_stats) and a last event with no choices and the usage."""
    server, tokens, req = run.server, run.tokens, run.req
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": run.model,
    }
    try:
        for i in range(tokens):
            if i == 0:
                await run.first_token()
            else:
                await asyncio.sleep(run.per_token_s)
            finish = "stop" if i == tokens - 1 else None
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"role": "assistant", "content": f"tok{i} "}
                 if i == 0 else {"content": f"tok{i} "}, "logprobs": None,
                 "finish_reason": finish}
                if chat
                else {"index": 0, "text": f"tok{i} ", "logprobs": None, "finish_reason": finish}
            )  # fmt: skip
            event: dict[str, Any] = {**head, "choices": [choice]}
            if req.include_usage:
                event["usage"] = run.usage(i + 1) if req.continuous_usage else None
            server.metrics.generation_tokens.inc()
            await response.write(_sse(event))
        if req.include_usage:
            await response.write(_sse({**head, "choices": [], "usage": run.usage(tokens)}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        pass  # the client left; aiohttp closes the connection
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    return await _infer(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _infer(request, chat=True)


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings (routing.standin.embeddings): one forward pass's time in a slot."""
    server = request.app[SERVER]
    settings = server.settings
    try:
        body = await _read_json(request)
        adapter = server.catalog.resolve(body.get("model"))
        req = EmbeddingRequest(
            body, embedding_dim=settings.embedding_dim, max_model_len=settings.max_model_len
        )
    except ApiError as exc:
        return _api_error(exc)
    fault = await server.fault()
    if fault is not None:
        return fault
    try:
        await server.slots.acquire()
    except QueueFull:
        return _busy(server)
    try:
        slow = SLOW_FACTOR if server.mode == "slow" else 1
        await asyncio.sleep(server.service_time.draw() * slow / settings.tokens / 1000)
        server.metrics.prompt_tokens.inc(sum(req.tokens))
        server.served += 1
        return web.json_response(req.response(adapter or settings.model))
    finally:
        server.slots.release()


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[SERVER].catalog.cards()})


async def get_model(request: web.Request) -> web.Response:
    try:
        card = request.app[SERVER].catalog.card(request.match_info["model"])
    except ApiError as exc:
        return _api_error(exc)
    return web.json_response(card)


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
    try:
        body = await _read_json(request)
    except ApiError as exc:
        return _error(exc.status, "invalid_json", exc.message, exc.param)
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
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
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
    # vLLM's own flags for what /v1/models lists and a request's `model` may name
    p.add_argument(
        "--served-model-name",
        metavar="MODEL",
        help="the model requests name; another is a 404 (default: --name, any name accepted)",
    )
    p.add_argument(
        "--lora-modules",
        "--lora",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME[=PATH]",
        help="LoRA adapters served beside the model (repeatable)",
    )
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--embedding-dim", type=int, default=384)
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
            served_model_name=args.served_model_name,
            lora_adapters=tuple(parse_lora(spec) for spec in args.lora_modules),
            max_loras=args.max_loras,
            max_model_len=args.max_model_len,
            embedding_dim=args.embedding_dim,
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
