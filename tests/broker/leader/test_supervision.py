"""A broker whose scheduler crashes says so, gives up leadership, and recovers: an in-process
Broker on the real etcd, the crash injected into its decision function."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.leader import decisions as dc
from broker.model.jobs import JobSpec
from broker.placement.settings import BrokerSettings
from broker.plan.problem import PlanInputError
from broker.process import Broker
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.errors import RegistryUnavailable
from sites.registry.client import Registry
from tests.conftest import CONFIGS

SETTINGS = BrokerSettings.model_validate(
    {"leader_ttl_s": 2, "tick_s": 0.1, "scheduling": {"batch_interval_s": 0.2}}
)


@pytest.fixture
async def broker(registry: Registry) -> AsyncIterator[Broker]:
    b = Broker(
        registry=registry, catalog=DeviceCatalog.load(CONFIGS / "devices.yaml"), settings=SETTINGS
    )
    await b.start()
    yield b
    await b.stop()


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_scheduler_crash_is_visible_resigns_and_recovers(
    broker: Broker, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    await until(lambda: broker.is_leader)
    real = dc.decide
    crashes = 0

    def decide(*args: Any, **kw: Any) -> dc.Decided:
        nonlocal crashes
        if crashes == 0:
            crashes += 1
            raise RuntimeError("injected scheduler bug")
        return real(*args, **kw)

    monkeypatch.setattr(dc, "decide", decide)
    record = await broker.submit(
        JobSpec.model_validate({"name": "j", "tenant": "t", "command": ["true"]})
    )
    await until(lambda: crashes == 1)
    health = broker.health()
    assert not health["healthy"]
    assert health["recent_crashes"][0]["task"] == "scheduler"
    assert "injected scheduler bug" in health["recent_crashes"][0]["error"]
    assert broker.metrics.task_crashes.labels("scheduler")._value.get() == 1
    # it gave up leadership: the lease is revoked, the key gone (no other replica here)
    await until(lambda: not broker.is_leader)
    await until(lambda: broker.view().jobs.get(record.id) is not None)
    # ... and after the hold-off it leads again and the scheduler decides on the job
    await until(lambda: broker.is_leader, timeout=15)
    await until(lambda: (broker.view().jobs[record.id][0].unschedulable or "") != "", timeout=10)
    assert "0/0 sites" in (broker.view().jobs[record.id][0].unschedulable or "")


async def test_leader_election_survives_etcd_errors(
    broker: Broker, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    await until(lambda: broker.is_leader)
    failures = 0
    real_keepalive = registry.keepalive

    async def keepalive(lease: int) -> int:
        nonlocal failures
        if failures < 3:
            failures += 1
            raise RegistryUnavailable("etcd is unreachable (injected)")
        return await real_keepalive(lease)

    monkeypatch.setattr(registry, "keepalive", keepalive)
    await until(lambda: failures == 3, timeout=10)
    # the election task did not die: it leads again once etcd answers
    await until(lambda: broker.is_leader, timeout=15)
    assert broker.health()["tasks"]["leader election"] == {"state": "running", "crashes": 0}
    got = await registry.get_raw(keys.LEADER)
    assert got is not None and broker.instance.encode() in got[0]


async def test_a_batch_problem_the_plan_refuses_skips_the_pass_not_the_scheduler(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    await until(lambda: broker.is_leader)

    def refuse(*args: Any, **kw: Any) -> Any:
        raise PlanInputError("jobs[0].cpu", "not a plan amount (injected)")

    monkeypatch.setattr(dc, "batch_problem", refuse)
    record = await broker.submit(
        JobSpec.model_validate({"name": "j", "tenant": "t", "command": ["true"]})
    )
    await until(lambda: broker.metrics.batch_errors._value.get() >= 1)
    # the fast path still decided on the job, and nothing crashed
    await until(lambda: (broker.view().jobs[record.id][0].unschedulable or "") != "")
    assert broker.health()["healthy"]
