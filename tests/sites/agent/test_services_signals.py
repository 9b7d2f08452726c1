"""The agent's service poller reads the model server's own signals from /metrics, and the agent
publishes them into the registry. Real processes (the stand-in model server, the agent), a
real etcd, real HTTP on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from sites.agent.collectors.services import Histogram, ServiceMonitor, parse_signals
from sites.model.spec import Service
from sites.registry.client import Registry
from tests.conftest import Processes, run_cpn, wait_for
from tests.routing.standins import StandIns
from tests.sites.agent.conftest import Serve

# SGLang cannot run here: this is a FAKE SGLang /metrics, with the names and types SGLang exports
SGLANG_FAKE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama"} 7.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="llama"} 0.42
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="llama"} 2.0
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="llama"} 4.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="llama"} 4.0
sglang:time_to_first_token_seconds_count{model_name="llama"} 4.0
sglang:time_to_first_token_seconds_sum{model_name="llama"} 0.8
"""


def svc(url: str, name: str = "chat") -> Service:
    return Service(name=name, model="m", url=url, max_concurrency=4)


async def load(url: str, n: int, prompt: str = "z" * 400) -> list[asyncio.Task[int]]:
    """n requests in flight at the server (each its own connection), until they finish."""

    async def one(http: aiohttp.ClientSession) -> int:
        async with http.post(url + "/v1/completions", json={"prompt": prompt}) as resp:
            await resp.read()
            return resp.status

    session = aiohttp.ClientSession()
    tasks = [asyncio.create_task(one(session)) for _ in range(n)]
    closer = asyncio.gather(*tasks, return_exceptions=True)
    closer.add_done_callback(lambda _: asyncio.ensure_future(session.close()))
    await asyncio.sleep(0.2)
    return tasks


@pytest.mark.e2e
async def test_the_poller_reads_vllm_signals_and_ttft_since_the_last_scrape(
    standins: StandIns,  # noqa: F811
) -> None:
    url = await standins.start(
        "qwen", "--median-ms", "600", "--p99-ms", "600", "--max-concurrency", "2"
    )
    clock = [1000.0]
    monitor = ServiceMonitor((svc(url),), clock=lambda: clock[0])
    try:
        tasks = await load(url, 3)
        await monitor.poll()
        busy = monitor.loads["chat"]
        assert busy.healthy and busy.signals == "vllm" and busy.signals_at == 1000.0
        assert (busy.in_flight, busy.queue) == (2, 1)  # vllm:num_requests_running / _waiting
        assert busy.kv_cache_usage is not None and busy.kv_cache_usage > 0
        # the two running requests had their first token after 600 / 8 ms
        assert busy.ttft_ms is not None and 70 <= busy.ttft_ms < 200
        assert await asyncio.gather(*tasks) == [200, 200, 200]
        clock[0] = 1002.0
        await monitor.poll()
        done = monitor.loads["chat"]
        assert (done.in_flight, done.queue, done.kv_cache_usage) == (0, 0, 0.0)
        assert done.signals_at == 1002.0
        assert done.latency_ms == pytest.approx(600, abs=1)  # /stats p50, queueing excluded
        # only what came since the last scrape: the third, which waited 600 ms for a slot
        assert done.ttft_ms is not None and 600 <= done.ttft_ms < 800
        assert done.ttft_p95_ms is not None and 500 <= done.ttft_p95_ms <= 750  # its bucket
        await monitor.poll()
        assert monitor.loads["chat"].ttft_ms is None  # no new first tokens since
    finally:
        await monitor.close()


@pytest.mark.e2e
async def test_a_blind_server_keeps_its_last_signals_and_their_time(
    standins: StandIns,  # noqa: F811
) -> None:
    url = await standins.start("blinded", "--median-ms", "800", "--p99-ms", "800")
    clock = [1000.0]
    monitor = ServiceMonitor((svc(url),), clock=lambda: clock[0])
    try:
        tasks = await load(url, 2)
        await monitor.poll()
        assert monitor.loads["chat"].signals_at == 1000.0
        async with aiohttp.ClientSession() as http:
            await http.post(url + "/admin/fail", json={"mode": "blind"})
        clock[0] = 1030.0
        await monitor.poll()
        blind = monitor.loads["chat"]
        # /metrics and /stats refuse, /healthz answers: healthy, with signals 30 s old
        assert blind.healthy and blind.signals == "vllm" and blind.signals_at == 1000.0
        assert blind.in_flight == 2
        await asyncio.gather(*tasks)
    finally:
        await monitor.close()


async def test_sglang_names_stats_only_and_health_only_servers(serve: Serve) -> None:
    async def sglang(_: web.Request) -> web.Response:
        return web.Response(text=SGLANG_FAKE, content_type="text/plain")

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"in_flight": 3, "queue": 1, "p50_ms": 120.0})

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="this is { not prometheus", content_type="text/plain")

    apps = {}
    for name, routes in {
        "sg": [("/metrics", sglang), ("/healthz", ok)],
        "stats": [("/metrics", garbage), ("/stats", stats)],
        "health": [("/healthz", ok)],
    }.items():
        app = web.Application()
        for path, handler in routes:
            app.router.add_get(path, handler)
        apps[name] = await serve(app)
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    services = (*(svc(url, name) for name, url in apps.items()), svc(dead, "dead"))
    monitor = ServiceMonitor(services, clock=lambda: 5.0)
    try:
        await monitor.poll()
    finally:
        await monitor.close()
    loads = monitor.loads
    sg = loads["sg"]
    assert (sg.signals, sg.in_flight, sg.queue, sg.kv_cache_usage) == ("sglang", 5, 7, 0.42)
    assert sg.ttft_ms == pytest.approx(200.0)  # 0.8 s over 4
    assert sg.ttft_p95_ms == pytest.approx((0.1 + 0.4 * (3.8 - 2) / 2) * 1000)
    st = loads["stats"]
    assert (st.signals, st.in_flight, st.queue, st.latency_ms) == ("stats", 3, 1, 120.0)
    assert st.kv_cache_usage is None and st.signals_at == 5.0
    hl = loads["health"]
    assert hl.healthy and hl.signals is None and hl.signals_at is None
    assert not loads["dead"].healthy


def test_histogram_deltas_survive_a_counter_reset() -> None:
    first = parse_signals(SGLANG_FAKE)
    assert first is not None and first.ttft is not None
    later = Histogram(((0.1, 3.0), (0.5, 8.0), (float("inf"), 9.0)), 9.0, 2.3)
    delta = later.since(first.ttft)
    assert (delta.count, delta.buckets[0][1]) == (5.0, 1.0)
    assert delta.mean_ms() == pytest.approx(300.0)
    restarted = Histogram(((0.1, 1.0), (0.5, 1.0), (float("inf"), 1.0)), 1.0, 0.05)
    assert restarted.since(later) is restarted  # the server restarted: all of it is new
    assert parse_signals("# TYPE other gauge\nother 1\n") is None
    with pytest.raises(ValueError):
        parse_signals("vllm:num_requests_running{ 1")


@pytest.mark.e2e
async def test_the_agent_publishes_the_signals_into_etcd(
    registry: Registry,
    processes: Processes,
    site_file: Callable[..., Path],
    standins: StandIns,  # noqa: F811
) -> None:
    url = await standins.start(
        "qwen", "--median-ms", "2500", "--p99-ms", "2500", "--max-concurrency", "2",
        "--served-model-name", "qwen", "--lora-modules", "sql=/lora/sql",
        "--max-model-len", "8192",
    )  # fmt: skip
    service = {"name": "chat", "model": "qwen", "url": url, "max_concurrency": 2}
    file = site_file("scraped", services=[service])
    assert run_cpn("site", "join", str(file), etcd_url=registry.url).returncode == 0
    processes.start(
        "agent", "--site", str(file), "--etcd", registry.url, "--interval", "0.5",
        "--probe-method", "http", name="agent-scraped",
    )  # fmt: skip

    def published(expected: tuple[int, int]) -> Callable[[], Awaitable[object]]:
        async def check() -> object:
            ep = (await registry.snapshot()).services.get(("chat", "scraped"))
            if ep is None or ep.signals != "vllm" or (ep.in_flight, ep.queue) != expected:
                return None
            return ep

        return check

    idle = await wait_for(published((0, 0)), timeout=20)  # the agent is up and scraping
    assert idle.kv_cache_usage == 0.0
    # from the stand-in's /v1/models: its context length and adapters (parent: `model`)
    assert (idle.max_model_len, idle.adapters) == (8192, ("sql",))
    tasks = await load(url, 3)  # two run for 2.5 s, one waits
    ep = await wait_for(published((2, 1)), timeout=10)
    assert ep.kv_cache_usage is not None and ep.kv_cache_usage > 0
    assert ep.signals_at is not None and abs(time.time() - ep.signals_at) < 5
    assert ep.signals_at <= ep.updated_at
    for task in tasks:
        task.cancel()
