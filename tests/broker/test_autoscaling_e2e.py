"""The live autoscaler end to end (docs/autoscaling.md, "The live loop"): real etcd, agent and
broker processes, stand-in model servers as the replicas. A load step through /v1/infer makes
the leader record a higher count, which the reconciler carries out; once the load stops it
records a lower one. Short delays (interval 1 s, up after 2 s, down after 4 s) keep it fast."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from broker.leader.scaler import AutoscalerRecord
from broker.model.services import ScalingDecision
from broker.state.traffic import TrafficSummary
from sites.model import keys
from tests.broker.conftest import SITES, Federation
from tests.conftest import AUTH

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

THREE = {name: SITES[name] for name in ("east-a", "east-b", "abroad")}
CLIENTS = {
    "client_regions": [
        {"id": "user-east", "attach": [{"site": "east-a"}, {"site": "east-b"}],
         "cidrs": ["10.1.0.0/16"]},
        {"id": "user-eu", "attach": [{"site": "abroad"}], "cidrs": ["10.2.0.0/16"]},
    ]
}  # fmt: skip

SERVICE = {
    "name": "auto",
    "tenant": "t1",
    "model": "standin-7b",
    "command": [
        sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:{port}",
        "--name", "auto", "--median-ms", "20", "--p99-ms", "40", "--max-concurrency", "16",
    ],
    "cpu": 1,
    "mem_gb": 0.5,
    "slo": {"p95_ms": 10000},
    "scaling": {
        "target_qps_per_replica": 4,
        "max_concurrency": 16,
        "interval_s": 1,
        "upscale_delay_s": 2,
        "downscale_delay_s": 4,
    },
    "min_replicas": 1,
    "max_replicas": 2,
    "clients": ["user-east"],
    "readiness": {"path": "/healthz", "period_s": 0.2},
    "drain_timeout_s": 5,
}  # fmt: skip


@pytest.fixture
def federation(make_federation: Callable[..., Federation], tmp_path: Path) -> Federation:
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (cfg / "clients.yaml").write_text(yaml.safe_dump(CLIENTS))
    return make_federation(THREE)


async def until(what: Callable[[], Any], timeout: float, why: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await what()
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"{why} within {timeout}s")


async def decision(fed: Federation) -> ScalingDecision | None:
    got = await fed.registry.get_raw(keys.scaling("auto"))
    return None if got is None else ScalingDecision.model_validate_json(got[0])


async def describe(http: aiohttp.ClientSession, fed: Federation) -> dict[str, Any]:
    async with http.get(fed.broker_url + "/v1/services/auto") as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]


def ready(view: dict[str, Any]) -> int:
    return sum(1 for r in view["replicas"] if r["state"] == "ready")


async def load(http: aiohttp.ClientSession, fed: Federation, rate_per_s: float) -> None:
    """Requests for `auto` from user-east at `rate_per_s`, until cancelled."""

    async def one() -> None:
        async with http.post(
            fed.broker_url + "/v1/infer/auto/v1/completions",
            json={"prompt": "hi"},
            headers={"X-Cpn-Client-Region": "user-east"},
        ) as resp:
            await resp.read()

    tasks: set[asyncio.Task[None]] = set()
    try:
        while True:
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(1 / rate_per_s)
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_load_step_scales_the_service_up_and_back_down(federation: Federation) -> None:
    fed = federation
    status, _ = fed.request("PUT", "/v1/services/auto", SERVICE)
    assert status == 201
    async with aiohttp.ClientSession(headers=AUTH) as http:
        await until(lambda: _ready(http, fed, 1), 30, "the first replica ready")
        # each broker replica publishes its gateway's traffic under its lease
        _, published = await fed.registry.list_prefix(keys.TRAFFIC)
        assert len(published) == 1
        TrafficSummary.model_validate_json(published[0][1])

        # 12 req/s at 4 per replica wants 3, capped at max_replicas 2: after the 2 s delay
        step = asyncio.create_task(load(http, fed, 12.0))
        try:
            up = await until(
                lambda: _count(fed, lambda n: n >= 2), 20, "a decision of 2 for user-east"
            )
            assert up.replicas == {"user-east": 2} and up.by == "autoscaler"
            await until(lambda: _ready(http, fed, 2), 25, "the second replica ready")
            view = await describe(http, fed)
            decided = [e for e in view["events"] if e["type"] == "decision"]
            assert any("east 1 -> 2" in e["message"] for e in decided), decided
            assert any(e["message"].startswith("first decision") for e in decided), decided
            assert any(e["type"] == "scaled-up" for e in view["events"])
        finally:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)

        # no more load: after the 4 s delay, back to min_replicas, and a replica drains
        down = await until(
            lambda: _count(fed, lambda n: n == 1), 20, "a decision of 1 after the load"
        )
        assert down.replicas == {"user-east": 1}
        view = await until(lambda: _scaled_down(http, fed), 15, "a replica scaled down")
        decided = [e for e in view["events"] if e["type"] == "decision"]
        assert any("2 -> 1" in e["message"] for e in decided), decided
        # the state the next leader goes on from
        got = await fed.registry.get_raw(keys.autoscaler_state("auto"))
        assert got is not None
        state = AutoscalerRecord.model_validate_json(got[0])
        assert sum(r.target for r in state.regions.values()) == 1
        health = json.loads(fed.get("/healthz")[1])
        assert health["healthy"], health


async def _ready(http: aiohttp.ClientSession, fed: Federation, n: int) -> bool:
    return ready(await describe(http, fed)) >= n


async def _count(fed: Federation, check: Callable[[int], bool]) -> ScalingDecision | None:
    got = await decision(fed)
    return got if got is not None and check(sum(got.replicas.values())) else None


async def _scaled_down(http: aiohttp.ClientSession, fed: Federation) -> dict[str, Any] | None:
    view = await describe(http, fed)
    return view if any(e["type"] == "scaled-down" for e in view["events"]) else None
