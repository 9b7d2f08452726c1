"""The service poller reads the model server's signals by today's vLLM names: the KV-cache gauge
(and its deprecated alias), the prefix-cache counters as a hit rate per scrape, the LoRA info
gauge, and /v1/models (rarely) for the context length and the adapters.

Real HTTP on loopback: the stand-in model server in-process, and a FAKE vLLM (an aiohttp app
serving a fixed exposition and model list, counting its /v1/models reads) where a test needs
an exposition the stand-in does not write.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from routing.standin.server import ModelServerSettings, make_app
from sites.agent.collectors.services import ServiceMonitor, parse_models, parse_signals
from sites.model.spec import Service
from sites.model.status import ServiceEndpoint
from tests.sites.agent.conftest import Serve

# vLLM V1's exposition (names, types and labels as vllm/v1/metrics/loggers.py writes them)
V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} {queries}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} {hits}
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="{running}",\
waiting_lora_adapters="{waiting}"} 1.8e9
"""
DEPRECATED = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="qwen"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="qwen"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="qwen"} 0.5
"""
BOTH = (
    DEPRECATED
    + """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="qwen"} 0.75
"""
)


def v1(queries: float = 0, hits: float = 0, running: str = "", waiting: str = "") -> str:
    return (
        V1.replace("{queries}", str(queries))
        .replace("{hits}", str(hits))
        .replace("{running}", running)
        .replace("{waiting}", waiting)
    )


def models(*adapters: str, max_model_len: int = 32768) -> dict[str, Any]:
    base = {"id": "qwen", "object": "model", "root": "Qwen/Qwen2.5-7B", "parent": None,
            "max_model_len": max_model_len}  # fmt: skip
    cards = [{"id": a, "object": "model", "root": f"/lora/{a}", "parent": "qwen",
              "max_model_len": max_model_len} for a in adapters]  # fmt: skip
    return {"object": "list", "data": [base, *cards]}


def test_kv_cache_usage_perc_first_then_the_deprecated_alias() -> None:
    current = parse_signals(v1())
    assert current is not None and current.kv_cache_usage == 0.25
    old = parse_signals(DEPRECATED)
    assert old is not None and old.kv_cache_usage == 0.5
    both = parse_signals(BOTH)
    assert both is not None and both.kv_cache_usage == 0.75  # the current name wins


def test_prefix_cache_hit_rate_is_per_scrape() -> None:
    first = parse_signals(v1(queries=1000, hits=250))
    assert first is not None
    assert first.prefix_since(None) == 0.25  # first contact: since the server started
    second = parse_signals(v1(queries=1400, hits=550))
    assert second is not None and second.prefix_since(first) == 0.75  # 300 of 400
    assert second.prefix_since(second) is None  # no lookups since: no rate
    restarted = parse_signals(v1(queries=100, hits=10))
    assert restarted is not None and restarted.prefix_since(second) == 0.1  # a reset
    assert parse_signals(DEPRECATED) is not None
    assert parse_signals(DEPRECATED).prefix_since(None) is None  # type: ignore[union-attr]


def test_lora_requests_info_names_the_newest_adapters() -> None:
    signals = parse_signals(v1(running="sql,tone", waiting="tone,chat"))
    assert signals is not None and signals.lora_adapters == ("chat", "sql", "tone")
    assert parse_signals(DEPRECATED).lora_adapters is None  # type: ignore[union-attr]


def test_parse_models_reads_the_context_length_and_the_adapters() -> None:
    assert parse_models(models("sql", "tone", max_model_len=8192)) == (8192, ("sql", "tone"))
    assert parse_models({"object": "list", "data": []}) == (None, ())
    many = models(*(f"a{i:03}" for i in range(100)))
    assert len(parse_models(many)[1]) == 64  # bounded, as ServiceEndpoint.adapters
    with pytest.raises(ValueError):
        parse_models({"error": "nope"})


class FakeVllm:
    """A FAKE vLLM: the exposition and model list the test sets; counts /v1/models reads."""

    def __init__(self) -> None:
        self.metrics = v1()
        self.models: dict[str, Any] = models("sql")
        self.models_status = 200
        self.model_reads = 0
        self.app = web.Application()
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")

    async def _models(self, _: web.Request) -> web.Response:
        self.model_reads += 1
        return web.json_response(self.models, status=self.models_status)


async def test_v1_models_is_read_on_first_contact_then_rarely(serve: Serve) -> None:
    fake = FakeVllm()
    url = await serve(fake.app)
    clock = [1000.0]
    monitor = ServiceMonitor(
        (Service(name="chat", model="qwen", url=url, max_concurrency=4),),
        clock=lambda: clock[0],
        models_every_s=60,
    )
    try:
        await monitor.poll()
        load = monitor.loads["chat"]
        assert (load.max_model_len, load.adapters, fake.model_reads) == (32768, ("sql",), 1)
        for _ in range(3):  # scrapes within the minute: no /v1/models
            clock[0] += 1
            await monitor.poll()
        assert fake.model_reads == 1
        # an adapter loaded since (vLLM's /v1/load_lora_adapter) shows in the LoRA gauge first
        fake.metrics = v1(running="tone")
        fake.models = models("sql", "tone")
        clock[0] += 1
        await monitor.poll()
        assert fake.model_reads == 2 and monitor.loads["chat"].adapters == ("sql", "tone")
        # a server whose /v1/models fails keeps what it last said, and is asked again later
        fake.models_status = 401
        clock[0] += 61
        await monitor.poll()
        clock[0] += 1
        await monitor.poll()
        assert fake.model_reads == 3
        assert monitor.loads["chat"].max_model_len == 32768
        endpoint = ServiceEndpoint(
            service="chat", site="s", model="qwen", url=url, max_concurrency=4,
            updated_at=clock[0], **monitor.loads["chat"].signal_fields(),
        )  # fmt: skip
        assert endpoint.adapters == ("sql", "tone") and endpoint.max_model_len == 32768
    finally:
        await monitor.close()


async def test_the_poller_reads_a_stand_ins_prefix_rate_and_adapters(serve: Serve) -> None:
    settings = ModelServerSettings(
        name="bj/chat", served_model_name="qwen", median_ms=10, p99_ms=10, max_concurrency=2,
        lora_adapters=[{"name": "sql", "path": "/lora/sql"}], max_model_len=4096,
        prefix_chars=256,
    )  # fmt: skip
    url = await serve(make_app(settings))
    monitor = ServiceMonitor((Service(name="chat", model="qwen", url=url, max_concurrency=2),))
    body = {"model": "sql", "prompt": "a" * 400, "max_tokens": 2}  # 100 tokens, 64 cached
    try:
        await monitor.poll()
        first = monitor.loads["chat"]
        assert (first.max_model_len, first.adapters) == (4096, ("sql",))
        assert first.prefix_cache_hit_rate is None  # nothing looked up yet
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
        await monitor.poll()
        assert monitor.loads["chat"].prefix_cache_hit_rate == pytest.approx(64 / 200)
        await monitor.poll()
        assert monitor.loads["chat"].prefix_cache_hit_rate is None  # none since
    finally:
        await monitor.close()


def test_old_endpoint_records_still_parse() -> None:
    old = {"service": "chat", "site": "s", "model": "m", "url": "http://h:1",
           "max_concurrency": 1, "updated_at": 1.0}  # fmt: skip
    ep = ServiceEndpoint.model_validate(old)
    assert (ep.prefix_cache_hit_rate, ep.max_model_len, ep.adapters) == (None, None, ())
    with pytest.raises(ValueError, match="prefix_cache_hit_rate"):
        ServiceEndpoint.model_validate({**old, "prefix_cache_hit_rate": 1.5})
