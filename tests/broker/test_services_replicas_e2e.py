"""Several replicas of a managed service at one site, and a fleet move, end to end
(docs/services.md): real etcd, agents, broker and stand-in model servers that drop what they
have in flight on SIGTERM (tests/broker/abrupt_modelserver.py), so only a drain saves a request.

One federation for the whole story, to stay fast on 2 cores: two replicas at one site both
ready and both served -> one of them drained with streams in flight while the other keeps
serving -> the fleet moved to another region with requests flowing, none refused (make
before break).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from broker.model.services import ScalingDecision
from sites.model import keys
from tests.broker.conftest import SITES, Federation
from tests.broker.test_services_e2e import (
    ABRUPT,
    _with,
    call,
    describe,
    ready,
    until,
)
from tests.conftest import AUTH

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TWO = {name: SITES[name] for name in ("east-a", "abroad")}
CLIENTS = {
    "client_regions": [
        {"id": "user-east", "attach": [{"site": "east-a"}], "cidrs": ["10.1.0.0/16"]},
        {"id": "user-eu", "attach": [{"site": "abroad"}], "cidrs": ["10.2.0.0/16"]},
    ]
}
SERVICE_MS = 3000  # a stream is still in flight when its replica's drain begins


def service_doc() -> dict[str, Any]:
    return {
        "name": "chat",
        "tenant": "t1",
        "model": "standin-7b",
        "command": [
            sys.executable, str(ABRUPT), "--listen", "127.0.0.1:{port}",
            "--name", "chat", "--median-ms", str(SERVICE_MS), "--p99-ms", str(SERVICE_MS),
            "--max-concurrency", "8", "--tokens", "15",
        ],
        "cpu": 1,
        "mem_gb": 0.5,
        "slo": {"p95_ms": 10000},
        "scaling": {"target_qps_per_replica": 5, "max_concurrency": 8},
        "min_replicas": 1,
        "max_replicas": 2,  # a move surges past it: the old ones serve until the new are ready
        "clients": ["user-east", "user-eu"],
        "readiness": {"path": "/healthz", "period_s": 0.2},
        "drain_timeout_s": 20,
    }  # fmt: skip


@pytest.fixture
def two_sites(make_federation: Callable[..., Federation], tmp_path: Path) -> Federation:
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (cfg / "clients.yaml").write_text(yaml.safe_dump(CLIENTS))
    return make_federation(TWO)


async def decide(fed: Federation, replicas: dict[str, int]) -> None:
    decision = ScalingDecision(
        service="chat", replicas=replicas, reason="test", at=time.time(), by="tests"
    )
    await fed.registry.put_raw(keys.scaling("chat"), decision.model_dump_json().encode())


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/stats") as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]


async def infer(http: aiohttp.ClientSession, fed: Federation, **body: Any) -> tuple[int, bytes]:
    async with http.post(
        fed.broker_url + "/v1/infer/chat/v1/completions",
        json={"prompt": "hi", **body},
        headers={"X-Cpn-Client-Region": "user-east"},
    ) as resp:
        return resp.status, await resp.read()


async def test_replicas_share_a_site_drain_alone_and_move_before_they_break(
    two_sites: Federation,
) -> None:
    fed = two_sites
    status, body = fed.request("PUT", "/v1/services/chat", service_doc())
    assert status == 201, body
    await decide(fed, {"user-east": 2})
    async with aiohttp.ClientSession(headers=AUTH) as http, aiohttp.ClientSession() as plain:
        # two replicas at the one site near user-east, each its own endpoint and port
        view = await until(
            lambda: _with(describe(http, fed), lambda v: len(ready(v)) == 2), 40, "two ready"
        )
        pair = ready(view)
        assert {r["site"] for r in pair} == {"east-a"}, view["replicas"]
        assert len({r["url"] for r in pair}) == 2
        _, kvs = await fed.registry.list_prefix(keys.site_replicas("east-a") + "chat/")
        assert sorted(k.rsplit("/", 1)[1] for k, _, _ in kvs) == sorted(r["job"] for r in pair)

        # both receive traffic (the gateway ranks the site, then draws a replica)
        async def both_served() -> bool:
            got = await asyncio.gather(*(infer(http, fed) for _ in range(8)))
            assert all(s == 200 for s, _ in got), got
            served = [(await stats(plain, r["url"]))["served"] for r in pair]
            return all(n > 0 for n in served)

        await until(both_served, 40, "both replicas served requests")

        # streams in flight on both, then one fewer: one replica drains, the other serves on
        streams = [
            asyncio.create_task(infer(http, fed, stream=True, max_tokens=15)) for _ in range(8)
        ]

        async def busy_both() -> bool:
            held = [(await stats(plain, r["url"]))["in_flight"] for r in pair]
            return all(n > 0 for n in held)

        await until(busy_both, 10, "streams in flight on both replicas")
        await decide(fed, {"user-east": 1})
        view = await until(
            lambda: _with(
                describe(http, fed), lambda v: any(r["state"] == "draining" for r in v["replicas"])
            ),
            10,
            "one replica draining",
        )
        gone = next(r for r in view["replicas"] if r["state"] == "draining")
        stays = next(r for r in pair if r["job"] != gone["job"])
        assert (await stats(plain, gone["url"]))["in_flight"] > 0  # its drain has work to save
        before = (await stats(plain, stays["url"]))["served"]
        status, _ = await infer(http, fed)
        assert status == 200
        assert (await stats(plain, stays["url"]))["served"] > before  # the same site serves on
        for status, body in await asyncio.gather(*streams):
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        view = await until(
            lambda: _with(describe(http, fed), lambda v: len(v["replicas"]) == 1),
            30,
            "the drained replica gone",
        )
        assert view["replicas"][0]["job"] == stays["job"]
        _, kvs = await fed.registry.list_prefix(keys.site_replicas("east-a") + "chat/")
        assert [k.rsplit("/", 1)[1] for k, _, _ in kvs] == [stays["job"]]  # its key withdrawn

        # the fleet moves to the other region; requests keep flowing and none is refused
        results: list[int] = []
        moving = True

        async def client(i: int) -> None:
            await asyncio.sleep(i * SERVICE_MS / 1000 / 12)  # a request starts every 0.25 s
            while moving:
                status, _ = await infer(http, fed)
                results.append(status)

        clients = [asyncio.create_task(client(i)) for i in range(12)]
        await asyncio.sleep(SERVICE_MS / 1000)
        try:
            await decide(fed, {"user-eu": 2})

            async def moved() -> dict[str, Any] | None:
                view = await describe(http, fed)
                there = {r["site"] for r in ready(view)} == {"abroad"}
                return view if there and len(view["replicas"]) == len(ready(view)) == 2 else None

            view = await until(moved, 60, "the fleet moved abroad")
            await asyncio.sleep(SERVICE_MS / 1000 + 0.5)  # and the new ones serve on their own
        finally:
            moving = False
            await asyncio.gather(*clients)
        assert len(results) >= 12, results
        assert all(s == 200 for s in results), [s for s in results if s != 200]
        # the old replica served until its replacements were ready
        assert "held" in [e["type"] for e in view["events"]]
        _, job = await call(http, fed, "GET", f"/v1/jobs/{stays['job']}")
        assert job["state"] == "CANCELLED"
