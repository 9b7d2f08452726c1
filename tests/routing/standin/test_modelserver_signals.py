"""The stand-in's model-server signals: vLLM-named /metrics, a KV cache and a prefix cache.

Real HTTP on loopback (in-process servers on 127.0.0.1:0); /metrics is read with
prometheus_client's own parser, as the agent reads it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from routing.standin.kvcache import PrefixCache
from routing.standin.server import ModelServer
from sites.agent.collectors.services import parse_signals

MakeServer = Callable[..., Awaitable[tuple[str, ModelServer]]]


STANDIN_DEFAULTS = {"name": "qwen-7b", "max_concurrency": 2}
"""This module's stand-ins (conftest's make_server)."""


async def families(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_metrics_carry_vllms_names_types_and_model_label(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    url, _ = await make_server(median_ms=300, p99_ms=300, max_concurrency=2)
    busy = [
        asyncio.create_task(_post(http, url, {"prompt": "x" * 400, "max_tokens": 16}))
        for _ in range(3)
    ]
    await asyncio.sleep(0.1)  # two running, one waiting
    fams = await families(http, url)
    types = {name: fams[name].type for name in fams if name.startswith("vllm:")}
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:num_requests_waiting"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert "vllm:gpu_cache_usage_perc" not in types  # deprecated, gone as in vLLM V1
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:prefix_cache_queries"] == "counter"

    def value(name: str) -> float:
        (sample,) = fams[name].samples
        assert sample.labels == {"model_name": "qwen-7b", "engine": "0"}
        return float(sample.value)

    assert value("vllm:num_requests_running") == 2
    assert value("vllm:num_requests_waiting") == 1
    # two running requests, each ceil((400 / 4 + 16) / 16) = 8 blocks of 4096
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(16 / 4096)
    await asyncio.gather(*busy)
    fams = await families(http, url)
    assert value("vllm:num_requests_running") == 0
    assert value("vllm:kv_cache_usage_perc") == 0
    counts = {s.name: s.value for s in fams["vllm:time_to_first_token_seconds"].samples}
    assert counts["vllm:time_to_first_token_seconds_count"] == 3
    # the third waited for a slot: TTFT is measured from arrival, queueing included
    assert counts["vllm:time_to_first_token_seconds_sum"] > 3 * 0.3 / 16
    buckets = [s.labels["le"] for s in fams["vllm:time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")]  # fmt: skip
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and buckets[-1] == "+Inf"
    # the agent's reading of the same exposition
    async with http.get(url + "/metrics") as resp:
        signals = parse_signals(await resp.text())
    assert signals is not None and signals.source == "vllm"
    assert (signals.running, signals.waiting, signals.kv_cache_usage) == (0, 0, 0.0)
    assert signals.ttft is not None and signals.ttft.count == 3


async def test_kv_cache_saturates_at_its_capacity(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    url, server = await make_server(
        median_ms=200, p99_ms=200, max_concurrency=4, kv_cache_blocks=10, kv_block_tokens=16
    )
    busy = [
        asyncio.create_task(_post(http, url, {"prompt": "y" * 256, "max_tokens": 16}))
        for _ in range(3)
    ]  # 5 blocks each: 15 held of 10
    await asyncio.sleep(0.08)
    assert server.kv.held == 15
    (sample,) = (await families(http, url))["vllm:kv_cache_usage_perc"].samples
    assert sample.value == 1.0
    async with http.get(url + "/stats") as resp:
        assert (await resp.json())["kv_cache_usage"] == 1.0
    await asyncio.gather(*busy)
    assert server.kv.held == 0


async def test_a_prefix_hit_makes_the_first_token_faster(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    url, _ = await make_server(
        median_ms=20, p99_ms=20, prefill_ms=150, prefix_hit_discount=0.8, prefix_chars=32
    )
    shared = "You are a helpful assistant. " * 4  # longer than prefix_chars
    cold = await _first_token_s(http, url, shared + "What is 2 + 2?")
    warm = await _first_token_s(http, url, shared + "Name a prime.")
    other = await _first_token_s(http, url, "Completely different. " * 4)
    assert cold > 0.15 and other > 0.15  # a miss pays the whole prefill
    assert warm < cold - 0.09  # a hit pays a fifth of it
    # the chat form: messages hash the same way, and the completion says it hit
    body = {"messages": [{"role": "system", "content": shared}], "max_tokens": 2}
    first = await _post(http, url, body, chat=True)
    again = await _post(http, url, body, chat=True)
    assert (first["cpn"]["prefix_hit"], again["cpn"]["prefix_hit"]) == (False, True)
    assert again["cpn"]["prefill_ms"] == pytest.approx(30.0)
    assert again["usage"]["prompt_tokens"] > 0
    async with http.get(url + "/stats") as resp:
        stats = await resp.json()
    assert (stats["prefix_queries"], stats["prefix_hits"]) == (5, 2)


def test_prefix_cache_is_an_lru_of_bounded_size() -> None:
    cache = PrefixCache(chars=4, entries=2)
    a, b, c = (cache.key(p) for p in ("aaaa-1", "bbbb", "cccc"))
    assert cache.key("aaaa-2") == a  # only the first `chars` characters count
    for key in (a, b):
        assert not cache.lookup(key)
        cache.store(key)
    assert cache.lookup(a)  # a is now the most recent
    cache.store(c)  # evicts b, the least recently used
    assert len(cache) == 2 and not cache.lookup(b) and cache.lookup(a) and cache.lookup(c)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
        ("/v1/completions", {"prompt": [1, None]}, "prompt"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"content": 3}]}, "messages[0].content"),
    ],
)
async def test_a_bad_prompt_is_a_400_naming_the_field(
    http: aiohttp.ClientSession, make_server: MakeServer, path: str, body: Any, field: str
) -> None:
    url, _ = await make_server()
    async with http.post(url + path, json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["field"] == field


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], *, chat: bool = False
) -> dict[str, Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        result: dict[str, Any] = await resp.json()
        return result


async def _first_token_s(http: aiohttp.ClientSession, url: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first event."""
    start = time.monotonic()
    body = {"prompt": prompt, "stream": True, "max_tokens": 4}
    async with http.post(url + "/v1/completions", json=body) as resp:
        line = await resp.content.readline()
        first = time.monotonic() - start
        assert line.startswith(b"data: ") and json.loads(line[6:])["choices"]
        await resp.read()
    return first
