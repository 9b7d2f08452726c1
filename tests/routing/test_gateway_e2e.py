"""Inference routing end to end: `cpn up` (agents, WAN emulation, stand-in model servers, broker)
on a real etcd, requests through the broker's /v1/infer and /v1/route on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml

from routing.decision.choice import hrw_weight
from sites.emulation.etcd_server import EmbeddedEtcd, free_port
from tests.conftest import AUTH, CONFIGS, REPO, clear_registry, cpn_cmd

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

# qwen-72b is served at yrd-demo-zone, shaoguan, zhangjiakou and tokyo
SITES = ("yrd-demo-zone", "wuhu", "shaoguan", "zhangjiakou", "tokyo", "frankfurt")
# tokyo's qwen-72b stand-in requires a key, as vLLM's --api-key does; the broker has it
TOKYO_KEY_ENV = "CPN_TEST_TOKYO_QWEN_KEY"
TOKYO_KEY = "sk-tokyo-" + os.urandom(8).hex()


class Demo:
    def __init__(self, url: str, up: subprocess.Popen[bytes], state: Path) -> None:
        self.url = url
        self.up = up
        self.state = state

    def model_server(self, site: str, service: str) -> psutil.Process:
        for child in psutil.Process(self.up.pid).children(recursive=True):
            try:
                argv = child.cmdline()
            except psutil.Error:  # ended meanwhile (a job's, a probe's): not a stand-in
                continue
            if f"{site}/{service}" in " ".join(argv):
                return child
        raise AssertionError(f"no stand-in for {site}/{service}")


@pytest.fixture(scope="module")
def demo(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    cfg = tmp_path_factory.mktemp("configs")
    for item in CONFIGS.iterdir():
        (shutil.copytree if item.is_dir() else shutil.copy)(item, cfg / item.name)
    fast = {
        "default": {"median_ms": 20, "p99_ms": 40},
        "models": {},
        "api_keys": {"tokyo/qwen-72b": TOKYO_KEY_ENV},
    }
    (cfg / "standin.yaml").write_text(yaml.safe_dump(fast))
    # short ejections and quick health checks, so a repaired site rejoins within the test
    inference = {
        "health_interval_s": 0.5,
        "outlier": {"base_ejection_time_s": 2, "max_ejection_time_s": 4},
        "site_keys": [{"site": "tokyo", "service": "qwen-72b", "key_env": TOKYO_KEY_ENV}],
    }
    (cfg / "broker.yaml").write_text(yaml.safe_dump({"inference": inference}))
    state = tmp_path_factory.mktemp("state")
    port = free_port()
    asyncio.run(clear_registry(etcd.url))
    log = open(state / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen(
        cpn_cmd("up", "--etcd", etcd.url, "--config-dir", str(cfg), "--sites", ",".join(SITES),
                "--interval", "0.5", "--broker-listen", f"127.0.0.1:{port}"),
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        env={**os.environ, "CPN_STATE_DIR": str(state), TOKYO_KEY_ENV: TOKYO_KEY},
    )  # fmt: skip
    log.close()
    demo = Demo(f"http://127.0.0.1:{port}", up, state)
    try:
        asyncio.run(_wait_routable(demo))
        yield demo
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
        asyncio.run(clear_registry(etcd.url))


async def _wait_routable(demo: Demo) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession(headers=AUTH) as http:
        while time.monotonic() < deadline:
            if demo.up.poll() is not None:
                raise AssertionError((demo.state / "up.log").read_text())
            try:
                async with http.post(
                    demo.url + "/v1/route",
                    json={"service": "qwen-72b", "client_region": "shanghai"},
                ) as resp:
                    body = await resp.json()
                    if resp.status == 200 and len(body["candidates"]) == 3:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise AssertionError("the demo never became routable")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=AUTH) as session:
        yield session


async def infer(
    http: aiohttp.ClientSession, demo: Demo, region: str, service: str = "qwen-72b", **headers: str
) -> tuple[int, dict[str, str], Any]:
    hdrs = {"X-Cpn-Client-Region": region, **headers}
    async with http.post(
        f"{demo.url}/v1/infer/{service}/v1/completions", json={"prompt": "hi"}, headers=hdrs
    ) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def test_a_site_that_requires_a_key_gets_the_brokers_not_the_clients(
    demo: Demo, http: aiohttp.ClientSession
) -> None:
    """tokyo's qwen-72b requires a key (vLLM's --api-key): the broker sends the one broker.yaml
    names (inference.site_keys, read from the environment), in place of the client's cpn
    token; without it the model server refuses."""
    cmdline = demo.model_server("tokyo", "qwen-72b").cmdline()
    direct = f"http://{cmdline[cmdline.index('--listen') + 1]}/v1/completions"
    async with aiohttp.ClientSession() as plain:
        for auth, want in ((None, 401), ("Bearer wrong", 401), (f"Bearer {TOKYO_KEY}", 200)):
            hdrs = {"Authorization": auth} if auth else {}
            async with plain.post(direct, json={"prompt": "hi"}, headers=hdrs) as resp:
                assert resp.status == want, (auth, await resp.text())
    status, headers, body = await infer(http, demo, "tokyo")
    assert status == 200, body
    assert headers["X-Cpn-Site"] == "tokyo"
    # a site without a key is unchanged: it gets no Authorization at all (the client's cpn
    # token stays with the broker)
    status, headers, body = await infer(http, demo, "shanghai")
    assert status == 200 and headers["X-Cpn-Site"] == "yrd-demo-zone", body


async def test_each_region_reaches_its_nearest_healthy_site(
    demo: Demo, http: aiohttp.ClientSession
) -> None:
    expected = {"shanghai": "yrd-demo-zone", "beijing": "zhangjiakou", "shenzhen": "shaoguan"}
    for region, site in expected.items():
        status, headers, body = await infer(http, demo, region)
        assert status == 200, body
        assert headers["X-Cpn-Site"] == site, (region, headers)
        assert float(headers["X-Cpn-Route-Ms"]) >= 0 and headers["X-Cpn-Attempts"] == "1"
    async with http.post(
        demo.url + "/v1/route", json={"service": "qwen-72b", "client_region": "shanghai"}
    ) as resp:
        route = await resp.json()
    parts = route["candidates"][0]
    assert route["site"] == "yrd-demo-zone"
    assert parts["total_ms"] == pytest.approx(
        parts["network_ms"] + parts["service_ms"] + parts["penalty_ms"], abs=0.01
    )
    assert [c["network_ms"] for c in route["candidates"]] == sorted(
        c["network_ms"] for c in route["candidates"]
    )


async def test_restricted_region_never_reaches_a_disallowed_region(
    demo: Demo, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        demo.url + "/v1/route", json={"service": "qwen-72b", "client_region": "shanghai"}
    ) as resp:
        route = await resp.json()
    assert {"site": "tokyo", "reason": "sovereignty"}.items() <= route["excluded"][0].items()
    served = Counter()
    for _ in range(30):
        _, headers, _ = await infer(http, demo, "shanghai", **{"X-Cpn-Session": f"k{_}"})
        served[headers["X-Cpn-Site"]] += 1
    assert "tokyo" not in served
    # an unrestricted region may use it
    _, headers, _ = await infer(http, demo, "tokyo")
    assert headers["X-Cpn-Site"] == "tokyo"


async def test_session_affinity_holds_for_a_key(demo: Demo, http: aiohttp.ClientSession) -> None:
    sites = set()
    for _ in range(15):
        status, headers, _ = await infer(http, demo, "frankfurt", **{"X-Cpn-Session": "user-42"})
        assert status == 200
        sites.add(headers["X-Cpn-Site"])
    assert len(sites) == 1


async def test_a_shared_prompt_prefix_stays_on_one_site(
    demo: Demo, http: aiohttp.ClientSession
) -> None:
    hdrs = {"X-Cpn-Client-Region": "shanghai"}
    homes = {}
    for team in range(6):
        system = f"Team {team}: you are the assistant of the operations team. " * 6  # > 256 B
        sites = set()
        for question in range(4):
            body = {"prompt": system + f"question {question}?", "max_tokens": 2}
            async with http.post(
                f"{demo.url}/v1/infer/qwen-72b/v1/completions", json=body, headers=hdrs
            ) as resp:
                assert resp.status == 200
                sites.add(resp.headers["X-Cpn-Site"])
        assert len(sites) == 1, (team, sites)  # one prefix, one site
        homes[team] = sites.pop()
    assert len(set(homes.values())) > 1, homes  # prefixes spread over the nearby sites
    async with http.post(
        demo.url + "/v1/route",
        json={"service": "qwen-72b", "client_region": "shanghai", "prefix_key": "doc-7"},
    ) as resp:
        route = await resp.json()
    assert resp.status == 200 and route["reasons"], route
    assert route["mode"] == "prefix" or route["home"] is not None, route["reasons"]
    # the agents of `cpn up` read the stand-ins' /metrics: every candidate has fresh signals
    ages = [c["signals_age_s"] for c in route["candidates"]]
    assert all(age is not None and age < 10 for age in ages), route["candidates"]


async def test_streamed_response_passes_through(demo: Demo, http: aiohttp.ClientSession) -> None:
    hdrs = {"X-Cpn-Client-Region": "shanghai"}
    body = {"prompt": "hi", "stream": True, "max_tokens": 6}
    events = []
    async with http.post(
        f"{demo.url}/v1/infer/qwen-72b/v1/completions", json=body, headers=hdrs
    ) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]" and len(events) == 7
    assert all(json.loads(e)["choices"] for e in events[:-1])


async def test_bad_input_gets_a_clear_4xx(demo: Demo, http: aiohttp.ClientSession) -> None:
    status, _, body = await infer(http, demo, "shanghai", service="no-such-model")
    assert status == 404 and body["error"]["code"] == "unknown_service"
    async with http.post(f"{demo.url}/v1/infer/qwen-72b/v1/completions", json={}) as resp:
        body = await resp.json()
        assert resp.status == 400 and body["error"]["field"] == "X-Cpn-Client-Region"
    status, _, body = await infer(http, demo, "atlantis")
    assert status == 400 and body["error"]["code"] == "unknown_region"
    big = io.BytesIO(b"x" * (5 * 1024 * 1024))
    async with http.post(
        f"{demo.url}/v1/infer/qwen-72b/v1/completions",
        data=big,
        headers={"X-Cpn-Client-Region": "shanghai"},
    ) as resp:
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "too_large"
    for body_json, field in (
        ({"client_region": "shanghai"}, "service"),
        ({"service": "qwen-72b"}, "client_region"),
        ({"service": "qwen-72b", "client_region": "atlantis"}, "client_region"),
    ):
        async with http.post(demo.url + "/v1/route", json=body_json) as resp:
            answer = await resp.json()
            assert resp.status == 400 and answer["error"]["field"] == field, answer
    async with http.post(
        demo.url + "/v1/route", json={"service": "nope", "client_region": "shanghai"}
    ) as resp:
        assert resp.status == 404


async def test_killed_site_gets_no_traffic_after_its_first_failure(
    demo: Demo, http: aiohttp.ClientSession
) -> None:
    """Last: it kills yrd-demo-zone's model server for good."""
    server = demo.model_server("yrd-demo-zone", "qwen-72b")
    results: list[tuple[int, str]] = []

    async def client(n: int) -> None:
        for i in range(10):
            status, headers, _ = await infer(
                http, demo, "shanghai", **{"Idempotency-Key": f"{n}-{i}"}
            )
            results.append((status, headers.get("X-Cpn-Site", "")))
            await asyncio.sleep(0.02)

    traffic = asyncio.gather(*(client(n) for n in range(4)))
    await asyncio.sleep(0.1)
    server.kill()
    await traffic
    assert all(status == 200 for status, _ in results), results
    sites = [site for _, site in results]
    assert "yrd-demo-zone" in sites  # it served before it died
    last_yrd = max(i for i, site in enumerate(sites) if site == "yrd-demo-zone")
    after = sites[last_yrd + 1 :]
    assert after and "yrd-demo-zone" not in after
    # new requests keep away from it
    for _ in range(10):
        status, headers, _ = await infer(http, demo, "shanghai")
        assert status == 200 and headers["X-Cpn-Site"] != "yrd-demo-zone"
    # repaired (a new server on its port): it rejoins once healthy and its ejection has run out
    repaired = subprocess.Popen(
        [sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:18100",
         "--name", "repaired", "--median-ms", "20", "--p99-ms", "40", "--max-concurrency", "32"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    # a session key that rendezvous hashing puts on yrd-demo-zone among Shanghai's sites
    pool = ("yrd-demo-zone", "shaoguan", "zhangjiakou")
    key = next(
        k
        for k in (f"s{i}" for i in range(1000))
        if max(pool, key=lambda site: hrw_weight(k, site)) == "yrd-demo-zone"
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            status, headers, _ = await infer(http, demo, "shanghai", **{"X-Cpn-Session": key})
            if headers.get("X-Cpn-Site") == "yrd-demo-zone":
                break
            assert time.monotonic() < deadline, "the repaired site never rejoined"
            await asyncio.sleep(0.3)
    finally:
        repaired.terminate()
        repaired.wait(10)


async def test_overloaded_site_sheds_its_share_and_gets_it_back(
    demo: Demo, http: aiohttp.ClientSession
) -> None:
    """zhangjiakou serves beijing: slow it down and fill it, then let it drain."""
    backend = "http://127.0.0.1:18101"  # zhangjiakou's qwen-72b stand-in (its site file)
    async with http.post(backend + "/admin/fail", json={"mode": "slow"}) as resp:
        assert resp.status == 200
    # 24 slots: 24 in flight + 32 queued is over 1.5 x the slots: the site counts as full.
    # Each of 56 clients sends its next request when the last one is answered, so the site stays
    # full until the test lets go (a one-shot burst drains in ~2 s, and on a loaded machine the
    # first probe could queue behind it and miss the window in which the report says "full").
    holding = True

    async def hold() -> None:
        while holding:
            async with http.post(backend + "/v1/completions", json={"prompt": "x"}) as resp:
                await resp.read()

    load = [asyncio.ensure_future(hold()) for _ in range(56)]
    try:

        async def moved() -> bool:
            _, headers, _ = await infer(http, demo, "beijing")
            return headers["X-Cpn-Site"] != "zhangjiakou"

        deadline = time.monotonic() + 10
        while not await moved():
            assert time.monotonic() < deadline, "traffic never left the full site"
            await asyncio.sleep(0.2)
        sites = Counter()
        for _ in range(10):
            _, headers, _ = await infer(http, demo, "beijing")
            sites[headers["X-Cpn-Site"]] += 1
        assert sites["zhangjiakou"] == 0, sites
    finally:
        holding = False
        async with http.post(backend + "/admin/fail", json={"mode": "ok"}) as resp:
            assert resp.status == 200
        await asyncio.gather(*load, return_exceptions=True)
    deadline = time.monotonic() + 20
    while True:
        _, headers, _ = await infer(http, demo, "beijing")
        if headers["X-Cpn-Site"] == "zhangjiakou":
            break
        assert time.monotonic() < deadline, "traffic never came back"
        await asyncio.sleep(0.2)
