"""The autoscaler loop in a leader broker (in process, on the real etcd): another broker
replica's published traffic makes it record a decision, and no bad input (a service record
that does not parse, a traffic summary or a stored state that does not) stops it or the other
services."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.leader.scaler import AutoscalerRecord, RegionRecord
from broker.model.services import ScalingDecision, ServiceSpec
from broker.placement.settings import BrokerSettings
from broker.process import Broker
from broker.state.traffic import TrafficBook
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from tests.conftest import CONFIGS, site_doc

SETTINGS = BrokerSettings.model_validate({"leader_ttl_s": 2, "tick_s": 0.1})


@pytest.fixture
async def broker(registry: Registry) -> AsyncIterator[Broker]:
    await registry.join(SiteSpec.model_validate(site_doc("east-a", region="east")), now=1.0)
    b = Broker(
        registry=registry,
        catalog=DeviceCatalog.load(CONFIGS / "devices.yaml"),
        user_rtt_ms={("user-east", "east-a"): 5.0},
        settings=SETTINGS,
    )
    await b.start()
    yield b
    await b.stop()


def service(name: str, **scaling: Any) -> ServiceSpec:
    doc: dict[str, Any] = {
        "name": name,
        "tenant": "t1",
        "model": "m",
        "command": "serve --port {port}",
        "slo": {"p95_ms": 500},
        "scaling": {
            "target_qps_per_replica": 2,
            "interval_s": 1,
            "upscale_delay_s": 0,
            **scaling,
        },
        "min_replicas": 1,
        "max_replicas": 3,
        "clients": ["user-east"],
    }
    return ServiceSpec.model_validate(doc)


async def until(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")


async def other_gateway(registry: Registry, rate_per_s: float) -> None:
    """Another broker replica's traffic summaries: `rate_per_s` requests for "good" from
    user-east, each answered in 80 ms."""
    book = TrafficBook()
    started = time.time()
    while True:
        for _ in range(round(rate_per_s / 4)):
            book.request("good", "user-east")
            book.first_byte("good", "user-east", 0.080)
        summary = book.summary("other", started, time.time())
        await registry.put_raw(keys.traffic("other"), summary.model_dump_json().encode())
        await asyncio.sleep(0.25)


async def test_the_leader_decides_from_published_traffic_and_bad_input_stops_nothing(
    broker: Broker, registry: Registry
) -> None:
    await until(lambda: asyncio.sleep(0, broker.is_leader))
    await broker.services.apply(service("good"))
    await registry.put_raw(keys.service_spec("broken"), b"{not a record")
    await registry.put_raw(keys.traffic("junk"), b"[1, 2")
    await registry.put_raw(keys.autoscaler_state("good"), b"{no state")
    # its min_replicas' replica, pending (no agent here), in the view
    first = await until(lambda: _replicas(broker))
    await until(lambda: asyncio.sleep(0, first[0].job in broker.view().jobs))
    feed = asyncio.create_task(other_gateway(registry, 20.0))
    try:

        async def decided() -> ScalingDecision | None:
            got = await registry.get_raw(keys.scaling("good"))
            if got is None:
                return None
            decision = ScalingDecision.model_validate_json(got[0])
            return decision if decision.replicas.get("user-east", 0) >= 3 else None

        # ~20 req/s at 2 per replica wants 10, capped at max_replicas 3; the pending replica
        # counts in "east", the region nearest to its client region
        decision = await until(decided)
        assert decision.by == "autoscaler"
        assert decision.replicas == {"user-east": 3}
    finally:
        feed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feed
    view = await broker.services.get("good")
    events = [e for e in view.events if e.type == "decision"]
    assert any("east 1 -> 3" in e.message and e.region == "user-east" for e in events), events
    got = await registry.get_raw(keys.autoscaler_state("good"))
    assert got is not None
    assert AutoscalerRecord.model_validate_json(got[0]).regions["east"].target == 3
    # this replica publishes its own summary too, under its lease
    assert await registry.get_raw(keys.traffic(broker.instance)) is not None
    errors = broker.metrics.service_errors
    assert errors.labels("broken")._value.get() >= 1  # noqa: SLF001 - the counter's value
    health = broker.health()
    assert health["healthy"] and health["leader"], health

    # deleted: once its record is gone, so are its decision and the autoscaler's state
    await broker.services.delete("good")

    async def forgotten() -> bool:
        left = [
            await registry.get_raw(k) for k in (keys.scaling("good"), keys.autoscaler_state("good"))
        ]
        return left == [None, None]

    await until(forgotten)


async def _replicas(broker: Broker) -> Any:
    return (await broker.services.get("good")).replicas


async def test_a_new_leader_goes_on_from_the_stored_state(
    broker: Broker, registry: Registry
) -> None:
    """A run of wanting more that began under the previous leader keeps counting: with a 30 s
    upscale delay begun 60 s ago, the first decision this leader makes scales up."""
    await until(lambda: asyncio.sleep(0, broker.is_leader))
    await broker.services.apply(service("good", upscale_delay_s=30))
    first = await until(lambda: _replicas(broker))
    await until(lambda: asyncio.sleep(0, first[0].job in broker.view().jobs))
    began = time.time() - 60
    left = AutoscalerRecord(
        service="good", at=began, regions={"east": RegionRecord(target=1, up_since=began)}
    )
    await registry.put_raw(keys.autoscaler_state("good"), left.model_dump_json().encode())
    feed = asyncio.create_task(other_gateway(registry, 20.0))
    try:

        async def decided() -> ScalingDecision | None:
            got = await registry.get_raw(keys.scaling("good"))
            if got is None:
                return None
            decision = ScalingDecision.model_validate_json(got[0])
            return decision if decision.replicas.get("user-east", 0) >= 3 else None

        started = time.monotonic()
        await until(decided, timeout=10)
        assert time.monotonic() - started < 10  # not the 30 s a fresh run would wait
    finally:
        feed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feed
    events = [e for e in (await broker.services.get("good")).events if e.type == "decision"]
    assert any("wanted more for 6" in e.message for e in events), events
