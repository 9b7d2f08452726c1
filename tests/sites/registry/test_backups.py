"""Backups on a real etcd (sites.registry.backups, broker.leader.backups): a snapshot written
whole with its description, retention, a damaged file refused, an unfinished one never
listed, and the leader's schedule."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker.leader.backups import BackupKeeper
from broker.placement.settings import BackupSettings
from broker.state.metrics import BrokerMetrics
from sites.kits.clock import SystemClock
from sites.model.errors import RegistryError
from sites.registry.backups import BackupError, BackupStore, backup_name
from sites.registry.client import Registry
from tests.broker.history_data import leading


async def test_a_backup_is_the_snapshot_and_its_description(
    registry: Registry, tmp_path: Path
) -> None:
    await registry.put_raw("/cpn/v1/test-backup/a", b"1")
    store = BackupStore(tmp_path / "b", keep=2)
    now = time.time()
    infos = [await store.take(registry, now=now + i) for i in range(3)]
    assert [i.name for i in store.backups()] == [infos[1].name, infos[2].name]  # keep=2
    assert not store.path(infos[0].name).exists() and not store.info_path(infos[0].name).exists()
    newest = store.check(infos[2].name)
    assert newest.revision >= await registry.revision() - 1
    assert newest.size_bytes == store.path(newest.name).stat().st_size > 0
    assert newest.member and newest.registry == registry.url
    assert sorted(p.name for p in store.directory.iterdir()) == sorted(
        f"{i.name}{ext}" for i in infos[1:] for ext in (".db", ".json")
    )  # nothing temporary is left


async def test_a_damaged_or_unfinished_backup_is_refused(
    registry: Registry, tmp_path: Path
) -> None:
    store = BackupStore(tmp_path)
    info = await store.take(registry, now=time.time())
    path = store.path(info.name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BackupError, match="the file is damaged"):
        store.check(info.name)
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(BackupError, match="100 bytes, its description says"):
        store.check(info.name)
    with pytest.raises(BackupError, match="no backup 'cpn-nope'"):
        store.check("cpn-nope")
    # a snapshot whose description was never written is not a backup
    unfinished = backup_name(time.time() + 60)
    store.path(unfinished).write_bytes(b"x")
    assert [i.name for i in store.backups()] == [info.name]


async def test_an_unreachable_registry_leaves_nothing_behind(tmp_path: Path) -> None:
    store = BackupStore(tmp_path)
    reg = Registry.from_urls("http://127.0.0.1:9", timeout_s=1)  # nothing listens there
    try:
        with pytest.raises(RegistryError):
            await store.take(reg, now=time.time())
    finally:
        await reg.close()
    assert list(tmp_path.iterdir()) == []


def test_keep_is_not_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 0"):
        BackupStore(tmp_path, keep=-1)


class StepClock(SystemClock):
    """Wall time that moves only when the test says (the keeper reads nothing else)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


async def test_the_leader_backs_up_one_interval_after_the_newest(
    registry: Registry, tmp_path: Path
) -> None:
    clock = StepClock(time.time())
    settings = BackupSettings(interval_s=3600, keep=2)
    async with leading(registry, "backups-test") as leadership:
        keeper = BackupKeeper(
            registry=registry,
            leadership=leadership,
            settings=settings,
            directory=tmp_path,
            clock=clock,
            metrics=BrokerMetrics(),
        )
        assert await keeper.take_if_due() is None  # not one at once
        clock.now += 3600
        first = await keeper.take_if_due()
        assert first is not None and first.taken_at == clock.now
        clock.now += 3599
        assert await keeper.take_if_due() is None  # the next is an interval after it
        for _ in range(2):
            clock.now += 3600
            assert await keeper.take_if_due() is not None
        assert len(keeper.store.backups()) == 2  # keep
        metrics = keeper.metrics
        assert metrics is not None
        assert metrics.backups.labels("ok")._value.get() == 3
        assert metrics.backup_last_success._value.get() == clock.now
        # a new leader (a new keeper) goes on from the newest in the directory
        again = BackupKeeper(
            registry=registry,
            leadership=leadership,
            settings=settings,
            directory=tmp_path,
            clock=clock,
        )
        assert again.due_at() == clock.now + 3600
