"""The replica reconciler in a leader broker (in process, on the real etcd): it carries out
each service's plan, and no service's bad input (a decision naming an unknown client region, a
decision that does not parse) stops it or the other services."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.model.services import ScalingDecision, ServiceSpec
from broker.placement.settings import BrokerSettings
from broker.process import Broker
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.registry.client import Registry
from tests.conftest import CONFIGS

SETTINGS = BrokerSettings.model_validate({"leader_ttl_s": 2, "tick_s": 0.1})


@pytest.fixture
async def broker(registry: Registry) -> AsyncIterator[Broker]:
    b = Broker(
        registry=registry,
        catalog=DeviceCatalog.load(CONFIGS / "devices.yaml"),
        user_rtt_ms={("user-east", "east-a"): 5.0},
        settings=SETTINGS,
    )
    await b.start()
    yield b
    await b.stop()


def service(name: str, **overrides: Any) -> ServiceSpec:
    doc: dict[str, Any] = {
        "name": name,
        "tenant": "t1",
        "model": "m",
        "command": "serve --port {port}",
        "slo": {"p95_ms": 500},
        "scaling": {"target_qps_per_replica": 5},
        "min_replicas": 1,
        "max_replicas": 3,
    }
    doc.update(overrides)
    return ServiceSpec.model_validate(doc)


async def until(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")


async def test_bad_decisions_do_not_stop_the_reconciler(broker: Broker, registry: Registry) -> None:
    await until(lambda: asyncio.sleep(0, broker.is_leader))
    await broker.services.apply(service("good"))
    await broker.services.apply(service("bad", clients=["user-east"]))
    unknown = ScalingDecision(service="bad", replicas={"atlantis": 2}, reason="x", at=time.time())
    await registry.put_raw(keys.scaling("bad"), unknown.model_dump_json().encode())
    await registry.put_raw(keys.scaling("good"), b"{not a decision")

    async def replicas(name: str) -> list[Any]:
        return (await broker.services.get(name)).replicas

    good = await until(lambda: replicas("good"))
    assert [r.region for r in good] == ["*"]  # its min_replicas, the bad decision ignored
    job = await broker.get(good[0].job)
    assert job.replica is not None and job.replica.service == "good"
    assert job.spec.group is None  # several may share a site: placement's capacity decides

    async def refused() -> bool:
        view = await broker.services.get("bad")
        return any(e.type == "error" and "atlantis" in e.message for e in view.events)

    await until(refused)
    # its other client region's replica is made all the same
    assert [r.region for r in await replicas("bad")] == ["user-east"]
    errors = broker.metrics.service_errors
    assert errors.labels("bad")._value.get() >= 1  # noqa: SLF001 - the counter's value
    assert errors.labels("good")._value.get() >= 1  # noqa: SLF001
    health = broker.health()
    assert health["healthy"] and health["leader"], health
