"""The tenancy in etcd: seeded once from configs/tenants.yaml, changed by guarded writes,
mirrored by every replica; the leader's fair-share history survives a change of leader. An
in-process Broker on the real etcd (broker.state.tenant_store)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker import process as service
from broker.model.errors import Conflict, InvalidRequest
from broker.model.tenants import TenancyFile, TenantPolicy
from broker.placement.settings import BrokerSettings
from broker.process import Broker
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.registry.client import Registry
from tests.conftest import CONFIGS

SETTINGS = BrokerSettings.model_validate({"leader_ttl_s": 2, "tick_s": 0.1})
CATALOG = DeviceCatalog.load(CONFIGS / "devices.yaml")
SEED = TenancyFile.model_validate(
    {
        "tenants": {
            "a": {"cohort": "lab", "quota": {"gpus": 8}, "weight": 2},
            "b": {"cohort": "lab", "quota": {"gpus": 8}},
        },
        "cohorts": {"lab": {}},
        "fair_share": {"half_life": "1d"},
    }
)


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture
async def broker(registry: Registry) -> AsyncIterator[Broker]:
    b = Broker(registry=registry, catalog=CATALOG, settings=SETTINGS, tenancy=SEED)
    await b.start()
    yield b
    await b.stop()


async def test_the_config_seeds_an_empty_registry_once(broker: Broker, registry: Registry) -> None:
    assert set(broker.tenancy.file.tenants) == {"a", "b"}
    assert broker.tenancy.quotas.empty().available("a") == {"gpus": 16.0}
    assert broker.tenancy.file.fair_share.half_life == 86400.0
    # a second replica started with another file keeps what the registry says
    other = Broker(
        registry=registry,
        catalog=CATALOG,
        settings=SETTINGS,
        tenancy=TenancyFile.model_validate({"tenants": {"z": {"gpus": 1}}}),
    )
    await other.start()
    try:
        assert set(other.tenancy.file.tenants) == {"a", "b"}
    finally:
        await other.stop()


async def test_writes_are_validated_guarded_and_mirrored(
    broker: Broker, registry: Registry
) -> None:
    book = broker.tenancy
    created = await book.put_tenant("c", TenantPolicy.model_validate({"quota": {"gpus": 2}}))
    assert created
    await until(lambda: "c" in broker.tenancy.file.tenants)
    with pytest.raises(InvalidRequest) as err:
        await book.put_tenant("d", TenantPolicy.model_validate({"cohort": "nowhere"}))
    assert "tenant d: unknown cohort 'nowhere'" in str(err.value)
    # a writer working from an older revision loses, with a 409
    raw = await registry.get_raw(keys.tenant_policy("c"))
    assert raw is not None
    await registry.put_raw(keys.tenant_policy("c"), b'{"quota": {"gpus": 3}}')
    await until(lambda: broker.tenancy.file.tenants["c"].quota.gpus == 3)
    seen = book._revisions["c"]
    book._revisions["c"] = raw[1]  # as if the mirror had not seen the write yet
    with pytest.raises(Conflict):
        await book.put_tenant("c", TenantPolicy.model_validate({"quota": {"gpus": 4}}))
    book._revisions["c"] = seen
    # a value that does not validate is skipped, never applied
    await registry.put_raw(keys.tenant_policy("e"), b'{"weight": -1}')
    await asyncio.sleep(0.3)
    assert "e" not in broker.tenancy.file.tenants
    assert await book.delete_tenant("c")
    await until(lambda: "c" not in broker.tenancy.file.tenants)


async def test_fair_share_history_survives_a_change_of_leader(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "FAIR_SHARE_SAVE_S", 0.0)
    first = Broker(registry=registry, catalog=CATALOG, settings=SETTINGS, tenancy=SEED)
    await first.start()
    await until(lambda: first.is_leader)
    await until(lambda: first._fair is not None)
    # history written straight into the registry's record, as a week of use would leave it
    got = await registry.get_raw(keys.FAIR_SHARE)
    await until(lambda: first.tenancy.fair is not None)
    assert got is not None
    record = json.loads(got[0])
    assert record["half_life_s"] == 86400.0
    await first.stop()
    now = time.time()
    history = {"at": now, "half_life_s": 86400.0, "levels": {"a": {"gpus": 6.0}}}
    await registry.put_raw(keys.FAIR_SHARE, json.dumps(history).encode())
    second = Broker(registry=registry, catalog=CATALOG, settings=SETTINGS, tenancy=SEED)
    await second.start()
    try:
        await until(lambda: second.is_leader, timeout=15)
        await until(lambda: second._fair is not None)
        fair = second._fair
        assert fair is not None and fair.at is not None and fair.at >= now
        # decayed by a few seconds of a one-day half-life, not started again from nothing
        assert fair.levels["a"]["gpus"] == pytest.approx(6.0, rel=1e-3)
    finally:
        await second.stop()
