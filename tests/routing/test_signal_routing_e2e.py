"""Routing on the model servers' own signals, end to end: two stand-in model servers (real
processes), their sites' agents (real processes) scraping /metrics into a real etcd, and the
gateway's router and proxy (in process, on loopback) reading the registry per request.

alpha is 3 ms nearer the client region than beta. The test follows one story:
1. both idle: a prefix's requests all go to its home (alpha, chosen for that), prefixes spread;
2. alpha loaded within prefix_slack_ms: the prefix stays; queue past it: plain requests and
   the prefix's go to beta (queue depth beats RTT; the prefix spills, naming its home);
3. beta's signals go stale (its /metrics stops answering while it still serves): it counts
   as saturated, so alpha serves although beta scores better on what it last reported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.state.router import Router, route_json
from routing.decision.choice import hrw_weight
from routing.decision.clients import parse_clients
from routing.decision.policy import RoutingSettings
from routing.decision.settings import ScoringSettings
from routing.gateway.health import OutlierDetector
from routing.gateway.prefix import prefix_key
from routing.gateway.proxy import InferenceProxy, Upstream, add_routes
from sites.model.latency import LatencyModel
from sites.model.status import ServiceEndpoint
from sites.registry.client import Registry
from tests.conftest import Processes, run_cpn, wait_for
from tests.routing.standins import StandIns

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

RTT = {"alpha": 5.0, "beta": 8.0}
STALE_S = 2.0
SETTINGS = RoutingSettings(
    prefix_slack_ms=10.0, scoring=ScoringSettings(signals_stale_after_s=STALE_S)
)
SYSTEM = "You are the on-call assistant of the platform team; answer briefly. " * 5
PREFIX_CHARS = 256


class Gateway:
    def __init__(self, registry: Registry, url: str) -> None:
        self.registry = registry
        self.url = url
        clients = parse_clients(
            "test",
            {
                "client_regions": [
                    {
                        "id": "city",
                        "attach": [{"site": s, "rtt_ms": ms} for s, ms in RTT.items()],
                    }
                ]
            },
        )
        self.router = Router(
            clients=clients, user_regions={}, latency=LatencyModel(), settings=SETTINGS, seed=1
        )

    async def route(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        self.router.sync(await self.registry.snapshot())
        key = None if body is None else prefix_key(_json(body), PREFIX_CHARS)
        return route_json(self.router.route("chat", "city", now=time.time(), prefix_key=key))

    async def pick(
        self,
        service: str,
        region: str | None,
        session_key: str | None,
        /,
        *,
        prefix_key: str | None = None,
    ) -> Sequence[Upstream]:
        self.router.sync(await self.registry.snapshot())
        assert region is not None
        result = self.router.route(
            service, region, now=time.time(), session_key=session_key, prefix_key=prefix_key
        )
        return [Upstream(site, url) for site, url in result.upstreams()]


def _json(body: dict[str, Any]) -> bytes:
    import json

    return json.dumps(body).encode()


@pytest.fixture
async def gateway(registry: Registry) -> AsyncIterator[Gateway]:
    holder: list[Gateway] = []

    async def pick(*args: Any, **kwargs: Any) -> Sequence[Upstream]:
        return await holder[0].pick(*args, **kwargs)

    proxy = InferenceProxy(
        pick=pick, health=OutlierDetector(), limiter=None, connect_timeout_s=1,
        response_timeout_s=10, max_attempts=2, max_body_bytes=1 << 20, prefix_chars=PREFIX_CHARS,
    )  # fmt: skip
    app = web.Application()
    add_routes(app, proxy)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gw = Gateway(registry, f"http://127.0.0.1:{runner.addresses[0][1]}")
    holder.append(gw)
    yield gw
    await proxy.close()
    await runner.cleanup()


async def infer(http: aiohttp.ClientSession, gw: Gateway, prompt: str) -> str:
    """The site that answered a completion through the proxy."""
    async with http.post(
        gw.url + "/v1/infer/chat/v1/completions",
        json={"prompt": prompt, "max_tokens": 2},
        headers={"X-Cpn-Client-Region": "city"},
    ) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["X-Cpn-Site"]


async def test_routing_follows_queue_depth_prefix_affinity_and_stale_signals(
    registry: Registry,
    processes: Processes,
    site_file: Callable[..., Path],
    standins: StandIns,  # noqa: F811
    gateway: Gateway,
) -> None:
    # 4 slots each; alpha's "slow" requests (x 50) run 5 s, long enough to watch its queue
    urls = {
        "alpha": await standins.start("qwen-alpha", "--median-ms", "100", "--p99-ms", "100"),
        "beta": await standins.start("qwen-beta", "--median-ms", "50", "--p99-ms", "50"),
    }
    files = [
        site_file(
            site,
            services=[{"name": "chat", "model": "qwen", "url": url, "max_concurrency": 4}],
        )
        for site, url in urls.items()
    ]
    assert run_cpn("site", "join", *map(str, files), etcd_url=registry.url).returncode == 0
    for file, site in zip(files, RTT, strict=True):
        processes.start(
            "agent", "--site", str(file), "--etcd", registry.url, "--interval", "0.5",
            "--probe-method", "http", name=f"agent-{site}",
        )  # fmt: skip

    def endpoint(
        site: str, check: Callable[[ServiceEndpoint], bool]
    ) -> Callable[[], Awaitable[Any]]:
        async def ready() -> Any:
            snap = await registry.snapshot()
            ep = snap.services.get(("chat", site))
            return ep is not None and site in snap.statuses and ep.signals == "vllm" and check(ep)

        return ready

    for site in RTT:
        await wait_for(endpoint(site, lambda ep: ep.in_flight == 0), timeout=30)

    # 1. idle: a prefix whose home is alpha keeps going there; prefixes spread over both
    prompts = [f"Team {i}. " + SYSTEM for i in range(12)]  # 12 system prompts
    keys = [prefix_key(_json({"prompt": p, "max_tokens": 2}), PREFIX_CHARS) for p in prompts]
    assert all(keys) and len(set(keys)) == len(keys)
    homes = {
        p: max(RTT, key=lambda s, k=k: hrw_weight(str(k), s))
        for p, k in zip(prompts, keys, strict=True)
    }
    ours = next(p for p in prompts if homes[p] == "alpha")
    async with aiohttp.ClientSession() as http:
        served = {p: await infer(http, gateway, p) for p in prompts}
        assert served == homes  # each prefix on its own home, both sites used
        assert set(served.values()) == set(RTT)
        assert {await infer(http, gateway, ours + "follow-up") for _ in range(3)} == {"alpha"}

        # 2. alpha loaded: 3 of 4 slots busy costs no wait yet
        async def slow(n: int) -> list[asyncio.Task[Any]]:
            await http.post(urls["alpha"] + "/admin/fail", json={"mode": "slow"})
            tasks = [
                asyncio.create_task(http.post(urls["alpha"] + "/v1/completions", json={}))
                for _ in range(n)
            ]
            await asyncio.sleep(0.15)  # admitted with the slow service time
            await http.post(urls["alpha"] + "/admin/fail", json={"mode": "ok"})
            return tasks

        load = await slow(3)
        await wait_for(endpoint("alpha", lambda ep: ep.in_flight == 3), timeout=5)
        kept = await gateway.route({"prompt": ours, "max_tokens": 2})
        assert (kept["site"], kept["mode"]) == ("alpha", "prefix"), kept["reasons"]
        assert await infer(http, gateway, ours) == "alpha"
        # past the slack: 4 running and 1 queued at alpha
        load += await slow(2)
        await wait_for(endpoint("alpha", lambda ep: (ep.in_flight, ep.queue) == (4, 1)), timeout=5)
        plain = await gateway.route()
        assert plain["site"] == "beta", plain["reasons"]
        # beta is reached through alpha too, so alpha is nearer by less than the access links':
        # by the measured alpha-beta link, a loopback one (0.036 ms in a quiet run). A CI run
        # saw a tie (no why-not reason: no site was nearer), so the reason is asked only when
        # alpha is strictly nearer; queue depth beating RTT is the site's check above
        network = {c["site"]: c["network_ms"] for c in plain["candidates"]}
        assert network["alpha"] <= network["beta"], plain["candidates"]
        if network["alpha"] < network["beta"]:
            assert any(
                r.startswith("alpha is ") and "ms nearer but lost on its queue" in r
                for r in plain["reasons"]
            ), plain["reasons"]
        spilled = await gateway.route({"prompt": ours, "max_tokens": 2})
        assert (spilled["site"], spilled["home"]) == ("beta", "alpha"), spilled["reasons"]
        assert "spilled from the prefix's home alpha" in spilled["reasons"][0]
        assert await infer(http, gateway, ours) == "beta"
        for resp in await asyncio.gather(*load):
            resp.release()

        # 3. alpha idle again, but its recent service times are slow ones: beta scores better
        await wait_for(endpoint("alpha", lambda ep: (ep.in_flight, ep.queue) == (0, 0)), timeout=12)
        assert (await gateway.route())["site"] == "beta"
        # beta goes blind: its last signals (idle) age past STALE_S and count as saturated
        await http.post(urls["beta"] + "/admin/fail", json={"mode": "blind"})
        blind_at = time.time()

        async def moved() -> Any:
            route = await gateway.route()
            return route if route["site"] == "alpha" else None

        route = await wait_for(moved, timeout=8)
        beta = (await registry.snapshot()).services[("chat", "beta")]
        # the agent kept publishing beta (healthy, fresh record) with its last signals' time
        assert beta.healthy and beta.signals_at is not None and beta.signals_at <= blind_at
        assert time.time() - beta.signals_at > STALE_S  # moved only once they were stale
        assert not route["overflow"]
        (excluded,) = route["excluded"]
        assert excluded["site"] == "beta" and excluded["reason"] == "full"
        assert "counted as saturated" in excluded["detail"]
        assert await infer(http, gateway, "plain request") == "alpha"
